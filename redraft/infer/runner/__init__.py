"""The runner room: the target's forwards and what they cost.

- :mod:`~redraft.infer.runner.verify`: :class:`Verifier` (prefill and the tree verify forward,
  static shapes); :mod:`~redraft.infer.runner.step_input`: :class:`StepInput` (the one packed
  step input: cache lengths and the tree);
- :mod:`~redraft.infer.runner.kv`: the slot KV cache; :mod:`~redraft.infer.runner.graphs`: CUDA
  graphs per shape; :mod:`~redraft.infer.runner.grouped_attention`: attention over tree masks;
  :mod:`~redraft.infer.runner.ragged`: prefill forwards as one flattened row (CPU);
- :mod:`~redraft.infer.runner.cost`: the verify-cost curve (:class:`CostCurve`, batched
  :class:`BatchCost`) and its measurement; :mod:`~redraft.infer.runner.clock`: step timestamps;
  :mod:`~redraft.infer.runner.opcount`: tensor ops a step dispatches.

The lowest room of :mod:`redraft.infer`: it imports no other.
"""
