"""The speculation room: what a step proposes and what it keeps, on the host.

- :mod:`~redraft.infer.spec.speculator`: :class:`Speculator` (propose -> tree -> choices ->
  accept -> feedback -> after_step) over a list of drafters;
- :mod:`~redraft.infer.spec.drafter`: the drafter interface (host and device drafters,
  :class:`Draft`, :class:`DecodeState`, :class:`Feedback`) and :mod:`~redraft.infer.spec.paths`
  (``PAD`` and the path helpers every room uses);
- :mod:`~redraft.infer.spec.accept`: the acceptance rules (greedy, rejection, typical) and the
  host walk; :mod:`~redraft.infer.spec.gate`: which drafters run (:class:`DrafterGate`) and
  whether speculating pays at a batch size (:class:`SpeculationGuard`);
- the host kernels: :mod:`~redraft.infer.spec.hostdraft` (n-gram drafting),
  :mod:`~redraft.infer.spec.hoststats` (acceptance rates, the node budget) and
  :mod:`~redraft.infer.spec.hosttree` (the packed tree), numpy reference code, and
  :mod:`~redraft.infer.spec.hostjit`, the same compiled with numba (their torch versions are the
  tests' oracles, tests/reference/).

It imports the runner room (:mod:`redraft.infer.runner`) and nothing above it.
"""
