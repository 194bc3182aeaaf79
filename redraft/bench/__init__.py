"""Benchmarks and diagnostics of the decoder: ``redraft-bench`` (``python -m redraft.bench``).

* :mod:`~redraft.bench.cli`: the command (``main``): decoding methods side by side on the same
  prompts, or ``--overhead``;
* :mod:`~redraft.bench.config`: its settings (``BenchSettings``, recipes, artifacts);
* :mod:`~redraft.bench.methods`: the registry of methods (redraft's, Hugging Face's, vLLM's);
* :mod:`~redraft.bench.run`: the runner (timing, aggregation, the markdown table);
* :mod:`~redraft.bench.prompts`: result labels and prompts fit to the target's context (the
  prompts themselves come from :func:`redraft.data.prompts.load_prompts`);
* :mod:`~redraft.bench.results`: measured runs as data (``--results-dir``);
* :mod:`~redraft.bench.report`: figures and a report (``--report``);
* :mod:`~redraft.bench.overhead`: host time and tensor ops per decode step (``--overhead``);
* :mod:`~redraft.bench.replies`: the engine against ``generate`` as the self-distillation reply
  generator (``python -m redraft.bench.replies``);
* :mod:`~redraft.bench.ties`: where two greedy outputs diverge, and whether it is a near-tie;
* :mod:`~redraft.bench.loadtest`: the server under concurrent streams
  (``python -m redraft.bench.loadtest``);
* :mod:`~redraft.bench.data`, :mod:`~redraft.bench.ngrams`, :mod:`~redraft.bench.train`: the
  data pipeline, the n-gram builders and lookups, and training steps
  (``python -m redraft.bench.data`` etc.).

A stage of its own above ``infer``, ``serve`` and ``vllm`` (and ``data``, ``ngrams``,
``train``): it drives them, and none of them imports it but ``redraft-vllm replay``, which
files its table as a result of this package's
(:mod:`~redraft.bench.results`; the one listed exception of the layering rule).
"""
