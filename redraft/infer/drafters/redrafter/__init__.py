"""The ReDrafter head as a drafter (:mod:`~redraft.infer.drafters.redrafter.drafter`,
:class:`ReDrafterDrafter`: beam search, "auto" width and length) and the beam search's measured
cost (:mod:`~redraft.infer.drafters.redrafter.beamcost`)."""
