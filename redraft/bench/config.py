"""``redraft-bench``'s settings: :class:`BenchSettings` and the decoder's
:class:`~redraft.infer.config.DecoderConfig`, both in the settings schema (redraft.settings):
each field is a recipe key and a flag. Defaults <- recipe <- flags, every value checked before
any work, and the output paths and artifacts checked before the target loads."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from redraft.cli import ModelSettings
from redraft.errors import ConfigError
from redraft.infer.config import DecoderConfig
from redraft.settings import Range, load_yaml, setting
from redraft.utils import ArgumentParser


@dataclass
class BenchSettings(ModelSettings):
    """Every setting of a ``redraft-bench`` run but the decoder's: each is a recipe key and (but
    ``chat_spec``) a flag. The model flags come from :class:`~redraft.cli.ModelSettings`."""

    KIND = "bench setting"

    dtype: str | None = setting("float32", "Target dtype: float32, bfloat16 or float16.")
    datasets: list[str] = setting(
        default_factory=lambda: ["chat", "code"],
        help="Comma list: 'chat' (held-out "
        "ShareGPT), 'code' (HumanEval), 'mt-bench:PATH' (MT-Bench question.jsonl) and JSONL "
        "files of prompts.",
    )
    chat_spec: str = setting(
        "default-chat", "The data spec 'chat' prompts are held out from.", cli=False
    )
    prompts: int = setting(20, "Prompts per dataset.", range=Range(1))
    repeat: int = setting(
        1,
        "Ask every prompt this many times (the whole set, then the whole set again): a server's "
        "workload where earlier requests' outputs matter (repeated questions, retries; the "
        "suffix method's global tree, vLLM's suffix cache).",
        range=Range(1),
    )
    max_new_tokens: int = setting(128, "New tokens per prompt.", range=Range(1))
    methods: list[str] = setting(
        default_factory=lambda: [
            "greedy",
            "hf-greedy",
            "hf-prompt-lookup",
            "context",
            "ngrammys",
            "redrafter",
            "mix",
        ],
        help="Comma list of methods (see --list-methods).",
    )
    prompt_lookup_num_tokens: int = setting(
        10, "hf-prompt-lookup's prompt_lookup_num_tokens.", range=Range(1)
    )
    retrieval_index: str | None = setting(
        None, "A draftretriever index, for the draftretriever method."
    )
    cost_curve_ms: str | None = setting(
        None,
        "Verify cost curve to use instead of measuring one, 'tokens:ms,...' "
        "(e.g. '1:63,8:116,16:146,64:245'), or a JSON file: an earlier run's --out "
        '(its measured curve, raw times included) or {"sizes": [...], "ms": [...]}; '
        "use it when the machine is too busy to measure, or to compare code on one curve.",
        flag="--cost-curve",
        metavar="COST_CURVE",
    )
    warmup: bool = setting(True, "Decode one short prompt per method before timing.")
    concurrency: list[int] = setting(
        default_factory=lambda: [1],
        help="Comma list of concurrent requests: 1 decodes the prompts one at a time (the "
        "table with tau); each larger value submits the prompts that many at a time to every "
        "method and reports tokens/s over the whole set (e.g. 1,4,16; leave 1 out to run only "
        "those).",
    )
    vllm_k: int = setting(
        5,
        "num_speculative_tokens of the vllm-ngram and vllm-redraft methods (vLLM's draft chain "
        "length; vllm-suffix keeps vLLM's own default, its tree depth 24, cut by the match "
        "length).",
        range=Range(1),
    )
    vllm_memory: float = setting(
        0.15,
        "gpu_memory_utilization of each vllm-* engine: the share of the device's memory (of "
        "the machine's memory on vLLM's CPU build) it may take for weights and KV cache.",
        range=Range(0.01, 1.0),
    )
    vllm_redraft: str | None = setting(
        None,
        "Settings of redraft's proposer in the vllm-redraft method, a JSON object (the keys of "
        'REDRAFT_VLLM_CONFIG, docs/vllm.md), e.g. \'{"cost": "off"}\'.',
    )
    twin: str | None = setting(
        None,
        "KEY=VALUE: every redraft method decodes each prompt a second time with this decoder "
        "setting changed, right after the first (an A/B of one setting in one run, e.g. "
        "lean_walk=false); the second rows are named 'method [KEY=VALUE]'.",
    )
    vllm_engines: str = setting(
        "one",
        "one: each vllm-* method decodes a dataset in a pass of its own after redraft's "
        "methods, its engine started for that pass and shut down after it (an idle engine's "
        "processes poll on the cores the timed method uses, and every pass starts with empty "
        "caches); all: every engine lives for the whole run and decodes prompt by prompt beside "
        "redraft's methods.",
        choices=("one", "all"),
    )
    vllm_max_model_len: int = setting(
        2048, "max_model_len of the vllm-* engines (prompt + new tokens).", range=Range(64)
    )
    overhead: bool = setting(
        False,
        "Instead: host time per decode step with a tiny random target (redraft.bench.overhead).",
    )
    overhead_batches: list[int] = setting(
        default_factory=lambda: [1, 8], help="Batch sizes of --overhead, comma list."
    )
    overhead_tokens: int = setting(200, "New tokens per row in --overhead.", range=Range(1))
    overhead_kernels: list[str] = setting(
        default_factory=lambda: ["jit"],
        help="Host kernels of --overhead: jit (numba, what the decoder uses where numba is "
        "installed), numpy (the reference code, as with REDRAFT_JIT=0), or jit,numpy: both in "
        "the same run, one after the other per method and batch (rows '<method> (numpy)').",
    )
    # ---- outputs
    out: str | None = setting(None, "Write the results as JSON to this file.")
    markdown: str | None = setting(
        None, "Write the Markdown table to this file (it is also printed)."
    )
    report: str | None = setting(None, "Write PNG plots and an index.md into this directory.")
    results_dir: str | None = setting(
        None,
        "When the run completes, also write it as data into this directory (e.g. "
        "benchmarks/results): <date>-<recipe>-<cpu>.json and .md, with the command, commit, "
        "machine and library versions.",
    )

    def check(self) -> None:
        if not self.datasets:
            raise ConfigError(
                "--datasets is empty; use chat, code, mt-bench:PATH or JSONL files.",
                param="datasets",
            )
        if not all(b >= 1 for b in self.overhead_batches):
            raise ConfigError(
                f"--overhead-batches {self.overhead_batches!r}: use batch sizes >= 1, e.g. 1,8.",
                param="overhead_batches",
            )
        if not self.concurrency or not all(c >= 1 for c in self.concurrency):
            raise ConfigError(
                f"--concurrency {self.concurrency!r}: use request counts >= 1, e.g. 1,4,16.",
                param="concurrency",
            )
        bad = [k for k in self.overhead_kernels if k not in ("jit", "numpy")]
        if bad or not self.overhead_kernels:
            raise ConfigError(
                f"--overhead-kernels {','.join(self.overhead_kernels)!r}: use jit, numpy or "
                f"jit,numpy.",
                param="overhead_kernels",
            )
        if self.cost_curve_ms:
            from redraft.infer.runner.cost import CostCurve

            try:
                CostCurve.from_ms(self.cost_curve_ms)
            except (ValueError, TypeError, KeyError, OSError):
                raise ConfigError(
                    f"cost curve {self.cost_curve_ms!r}: write 'tokens:ms,...', e.g. "
                    f"'1:63,8:116,16:146,64:245', or name a JSON file holding one (a "
                    f'redraft-bench --out file, or {{"sizes": [...], "ms": [...]}}).',
                    param="cost_curve_ms",
                ) from None


BENCH_DEFAULTS = BenchSettings().to_dict()  # what a run without a recipe or flags uses
OUTPUTS = ("out", "markdown", "report")
DESCRIPTION = "``redraft-bench``: decoding methods side by side, in one run, on the same prompts."


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="redraft-bench",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Defaults are those of infer/bench-default.yaml's keys when no recipe is given: "
        "target default, dtype float32, datasets chat,code, 20 prompts, 128 new tokens.",
    )
    g = p.add_argument_group("what to run")
    g.add_argument("--recipe", help="YAML file with any of these settings (flags override it)")
    g.add_argument(
        "--list-methods", action="store_true", help="print the methods, what each needs, and exit"
    )
    BenchSettings.add_arguments(g, exclude=OUTPUTS)
    o = BenchSettings.add_arguments(p, "outputs", only=OUTPUTS)
    o.add_argument(
        "--from-json",
        help="with --report (and/or --markdown): plot an earlier --out JSON, decode nothing",
    )
    DecoderConfig.add_arguments(p, "decoder settings (DecoderConfig; recipe keys of the same name)")
    return p


def resolve_config(args) -> tuple[dict, DecoderConfig]:
    """Bench settings (as a dict) and the decoder config: defaults <- recipe <- flags, every value
    read as its field's type and checked."""
    bench, dec = {}, {}
    if args.recipe:
        from redraft.resources import find_config

        path = find_config(args.recipe, "infer")  # a file, or a shipped name such as bench-default
        bench, dec = load_yaml(path, BenchSettings, DecoderConfig, what="recipe")
        bench = {k: BenchSettings.coerce(k, v, str(path)) for k, v in bench.items()}
        dec = {k: DecoderConfig.coerce(k, v, str(path)) for k, v in dec.items()}
    bench.update({k: BenchSettings.coerce(k, v) for k, v in BenchSettings.given(args).items()})
    dec.update({k: DecoderConfig.coerce(k, v) for k, v in DecoderConfig.given(args).items()})
    cfg = DecoderConfig.from_dict(dec, where=args.recipe or "the command line")
    return BenchSettings.from_dict(bench, where=args.recipe or "the command line").to_dict(), cfg


def twin_config(bench: dict, cfg: DecoderConfig) -> tuple[str, DecoderConfig] | None:
    """``--twin KEY=VALUE`` read and checked against the decoder settings: the twin rows' label
    (``[KEY=VALUE]``) and their decoder config; ``None`` without ``--twin``."""
    spec = bench.get("twin")
    if not spec:
        return None
    key, sep, value = (x.strip() for x in spec.partition("="))
    key = key.replace("-", "_")
    if not sep or not key:
        raise ConfigError(
            f"--twin {spec!r} is not KEY=VALUE; give a decoder setting and its value, e.g. "
            f"--twin lean_walk=false.",
            param="twin",
        )
    return f"[{key}={value}]", cfg.replace(**{key: DecoderConfig.coerce(key, value, "--twin")})


def check_outputs(bench: dict) -> None:
    """Refuse, before any work, output paths that cannot be written (a directory where a file is
    wanted, a file where a directory is wanted, a parent that cannot be created)."""
    for key in ("out", "markdown"):
        if bench[key]:
            p = Path(bench[key])
            if p.is_dir():
                raise ConfigError(
                    f"--{key} {p} is a directory; give a file path, e.g. "
                    f"{p / ('bench.json' if key == 'out' else 'bench.md')}.",
                    param=key,
                )
            _creatable(p.parent, key)
    if bench["report"]:
        p = Path(bench["report"])
        if p.exists() and not p.is_dir():
            raise ConfigError(
                f"--report {p} is a file; give a directory for the plots and index.md.",
                param="report",
            )
        _creatable(p, "report")


def _creatable(d: Path, key: str) -> None:
    import os

    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--{key}: cannot create directory {d} ({exc.strerror}).", param=key
        ) from None
    if not os.access(d, os.W_OK):
        raise ConfigError(f"--{key}: directory {d} is not writable.", param=key)


def resolve_artifacts(bench: dict) -> tuple[list[Path], list[Path], dict]:
    """Resolve artifact paths and read what the n-gram table sets hold, before loading the target."""
    from redraft.hub import resolve_artifact

    drafters = [resolve_artifact(p, kind="drafter") for p in bench["drafters"]]
    ngrams = [resolve_artifact(p, kind="ngrams") for p in bench["ngrams"]]
    kinds = set()
    for d in ngrams:
        try:
            kinds |= set(json.loads((d / "ngrams.json").read_text()).get("kinds", []))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{d / 'ngrams.json'} cannot be read ({exc}); pass a redraft-build-ngrams output."
            ) from exc
    idx = bench["retrieval_index"]
    if idx and not Path(idx).exists():
        raise ConfigError(f"--retrieval-index {idx} does not exist.", param="retrieval_index")
    from importlib.util import find_spec

    have = {"ngrams": kinds, "drafter": bool(drafters), "retrieval": bool(idx)}
    return drafters, ngrams, {**have, "vllm": find_spec("vllm") is not None}
