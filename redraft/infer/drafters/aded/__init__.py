"""ADED: corpus tri-grams drafted by MCTS (:mod:`~redraft.infer.drafters.aded.drafter`,
:class:`ADEDDrafter`; the search in :mod:`~redraft.infer.drafters.aded.mcts`)."""
