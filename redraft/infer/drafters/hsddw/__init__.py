"""HSDDW: self-verified drafting with an entropy threshold and a hierarchy of draft models
(:mod:`~redraft.infer.drafters.hsddw.drafter`, :class:`HSDDWDrafter`; the draft models in
:mod:`~redraft.infer.drafters.hsddw.models`)."""
