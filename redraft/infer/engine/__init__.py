"""The engine room: continuous batching over the speculative step.

- :mod:`~redraft.infer.engine.engine`: :class:`Engine` (requests in, rows, the step: retire ->
  propose -> tree -> verify -> accept -> commit -> advance -> emit);
- :mod:`~redraft.infer.engine.scheduler`: the prefill queue (which prompt tokens go into which
  forward) and :mod:`~redraft.infer.engine.pacer` (how large a prefill piece may be);
- :mod:`~redraft.infer.engine.batch`: rows joining the batch (their first token) and leaving it;
- :mod:`~redraft.infer.engine.rows`: a request's row and the host state the drafters read;
- :mod:`~redraft.infer.engine.text` (incremental detokenisation, stop strings) and
  :mod:`~redraft.infer.engine.processors` (penalties, logit bias, min_tokens).

It drives the speculator (:mod:`redraft.infer.spec`) and the verifier
(:mod:`redraft.infer.runner`) it is given, and imports neither the decoder nor any drafter.
"""
