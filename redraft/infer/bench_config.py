"""``redraft-bench``'s settings: defaults <- recipe <- flags, every value checked before any
work, and the output paths and artifacts checked before the target loads. Decoder settings are
:class:`~redraft.infer.config.DecoderConfig` fields: each is a recipe key and a flag."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from redraft.errors import ConfigError
from redraft.infer.config import FIELDS as DECODER_FIELDS
from redraft.infer.config import DecoderConfig
from redraft.utils import ArgumentParser

BENCH_DEFAULTS = {
    "target": "default", "dtype": "float32", "device": None, "datasets": ["chat", "code"], "prompts": 20,
    "max_new_tokens": 128, "methods": ["greedy", "hf-greedy", "hf-prompt-lookup", "context", "ngrammys", "redrafter",
                                       "mix"],
    "drafters": [], "ngrams": [], "prompt_lookup_num_tokens": 10, "out": None, "markdown": None, "report": None,
    "threads": None, "warmup": True, "chat_spec": "default-chat", "cost_curve_ms": None, "retrieval_index": None,
    "overhead": False, "overhead_batches": [1, 8], "overhead_tokens": 200,
}
DESCRIPTION = "``redraft-bench``: decoding methods side by side, in one run, on the same prompts."


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="redraft-bench", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="Defaults are those of infer/bench-default.yaml's keys when no recipe is given: "
                              "target default, dtype float32, datasets chat,code, 20 prompts, 128 new tokens.")
    g = p.add_argument_group("what to run")
    g.add_argument("--recipe", help="YAML file with any of these settings (flags override it)")
    g.add_argument("--target", help="target spec: 'default', hub id, local dir, .gguf or dummy:<shape>")
    g.add_argument("--dtype", help="target dtype: float32, bfloat16 or float16")
    g.add_argument("--device", help="torch device: cpu, cuda, cuda:N (default: cuda when available)")
    g.add_argument("--datasets", help="comma list: 'chat' (held-out ShareGPT), 'code' (HumanEval), "
                                      "'mt-bench:PATH' (MT-Bench question.jsonl) and JSONL files of prompts")
    g.add_argument("--prompts", type=int, help="prompts per dataset (>= 1)")
    g.add_argument("--max-new-tokens", type=int, help="new tokens per prompt (>= 1)")
    g.add_argument("--methods", help="comma list of methods (see --list-methods)")
    g.add_argument("--list-methods", action="store_true", help="print the methods, what each needs, and exit")
    g.add_argument("--drafter", action="append", help="ReDrafter artifact dir or hub id (repeatable)")
    g.add_argument("--ngrams", action="append", help="n-gram tables dir or hub id (repeatable)")
    g.add_argument("--retrieval-index", help="a draftretriever index, for the draftretriever method")
    g.add_argument("--prompt-lookup-num-tokens", type=int, help="hf-prompt-lookup's prompt_lookup_num_tokens")
    g.add_argument("--cost-curve", dest="cost_curve_ms",
                   help="verify cost curve to use instead of measuring one, 'tokens:ms,...' (e.g. "
                        "'1:63,8:116,16:146,64:245'); use it when the machine is too busy to measure")
    g.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="decode one short prompt per method before timing (default: on)")
    g.add_argument("--overhead", action="store_true", default=None,
                   help="instead: host time per decode step with a tiny random target (redraft.infer.overhead)")
    g.add_argument("--overhead-batches", help="batch sizes of --overhead, comma list (default 1,8)")
    g.add_argument("--overhead-tokens", type=int, help="new tokens per row in --overhead (default 200)")
    o = p.add_argument_group("outputs")
    o.add_argument("--out", help="write the results as JSON to this file")
    o.add_argument("--markdown", help="write the Markdown table to this file (it is also printed)")
    o.add_argument("--report", help="write PNG plots and an index.md into this directory")
    o.add_argument("--from-json", help="with --report (and/or --markdown): plot an earlier --out JSON, decode nothing")
    d = p.add_argument_group("decoder settings (DecoderConfig; recipe keys of the same name)")
    for name, f in DECODER_FIELDS.items():
        flag = "--" + name.replace("_", "-")
        if str(f.type).startswith("bool"):
            d.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=f.metadata["help"])
        else:
            d.add_argument(flag, dest=name, default=None, help=f.metadata["help"] + f" (default {f.default!r})")
    return p


def _yaml_value(v):
    import yaml

    return yaml.safe_load(v) if isinstance(v, str) else v


def resolve_config(args) -> tuple[dict, DecoderConfig]:
    """Bench settings and the decoder config: defaults <- recipe <- flags, every value checked."""
    bench = dict(BENCH_DEFAULTS)
    dec_values: dict = {}
    if args.recipe:
        import yaml

        from redraft.resources import find_config

        path = find_config(args.recipe, "infer")  # a file, or a shipped name such as bench-default
        try:
            rec = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"recipe {path} is not valid YAML: {exc}") from exc
        if not isinstance(rec, dict):
            raise ConfigError(f"recipe {path} must be a mapping of settings.")
        unknown = sorted(set(rec) - set(BENCH_DEFAULTS) - set(DECODER_FIELDS))
        if unknown:
            raise ConfigError(f"{path}: unknown keys {unknown}; valid: {sorted(set(BENCH_DEFAULTS) | set(DECODER_FIELDS))}.")
        bench.update({k: v for k, v in rec.items() if k in BENCH_DEFAULTS})
        dec_values.update({k: v for k, v in rec.items() if k in DECODER_FIELDS})
    flags = {k: getattr(args, k) for k in ("target", "dtype", "device", "prompts", "max_new_tokens", "threads", "out",
                                           "markdown", "report", "cost_curve_ms", "retrieval_index", "warmup",
                                           "prompt_lookup_num_tokens", "overhead", "overhead_tokens")}
    bench.update({k: v for k, v in flags.items() if v is not None})
    for key, flag in (("datasets", args.datasets), ("methods", args.methods), ("overhead_batches", args.overhead_batches)):
        if flag:
            bench[key] = flag.split(",")
    if args.drafter:
        bench["drafters"] = args.drafter
    if args.ngrams:
        bench["ngrams"] = args.ngrams
    for key in ("datasets", "methods", "drafters", "ngrams", "overhead_batches"):
        if isinstance(bench[key], str):
            bench[key] = [s for s in bench[key].split(",") if s]
        bench[key] = [s.strip() if isinstance(s, str) else s for s in bench[key] or [] if str(s).strip()]
    dec_values.update({k: _yaml_value(getattr(args, k)) for k in DECODER_FIELDS if getattr(args, k) is not None})
    cfg = DecoderConfig.from_dict(dec_values, where=args.recipe or "the command line")
    for key in ("prompts", "max_new_tokens", "overhead_tokens", "prompt_lookup_num_tokens"):
        v = bench[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"--{key.replace('_', '-')} {v!r}: use an integer >= 1.", param=key)
    try:
        bench["overhead_batches"] = [int(b) for b in bench["overhead_batches"]]
        assert all(b >= 1 for b in bench["overhead_batches"])
    except (ValueError, AssertionError):
        raise ConfigError(f"--overhead-batches {bench['overhead_batches']!r}: use batch sizes >= 1, e.g. 1,8.") from None
    if bench["threads"] is not None and (not isinstance(bench["threads"], int) or bench["threads"] < 1):
        raise ConfigError(f"--threads {bench['threads']!r}: use an integer >= 1.", param="threads")
    if bench["cost_curve_ms"]:
        from redraft.infer.budget import CostCurve

        try:
            CostCurve.from_ms(bench["cost_curve_ms"])
        except (ValueError, TypeError):
            raise ConfigError(f"cost curve {bench['cost_curve_ms']!r}: write 'tokens:ms,...', e.g. "
                              f"'1:63,8:116,16:146,64:245'.") from None
    if not bench["datasets"]:
        raise ConfigError("--datasets is empty; use chat, code, mt-bench:PATH or JSONL files.", param="datasets")
    return bench, cfg


def check_outputs(bench: dict) -> None:
    """Refuse, before any work, output paths that cannot be written (a directory where a file is
    wanted, a file where a directory is wanted, a parent that cannot be created)."""
    for key in ("out", "markdown"):
        if bench[key]:
            p = Path(bench[key])
            if p.is_dir():
                raise ConfigError(f"--{key} {p} is a directory; give a file path, e.g. {p / ('bench.json' if key == 'out' else 'bench.md')}.",
                                  param=key)
            _creatable(p.parent, key)
    if bench["report"]:
        p = Path(bench["report"])
        if p.exists() and not p.is_dir():
            raise ConfigError(f"--report {p} is a file; give a directory for the plots and index.md.", param="report")
        _creatable(p, "report")


def _creatable(d: Path, key: str) -> None:
    import os

    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--{key}: cannot create directory {d} ({exc.strerror}).", param=key) from None
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
            raise ConfigError(f"{d / 'ngrams.json'} cannot be read ({exc}); pass a redraft-build-ngrams output.") from exc
    idx = bench["retrieval_index"]
    if idx and not Path(idx).exists():
        raise ConfigError(f"--retrieval-index {idx} does not exist.", param="retrieval_index")
    return drafters, ngrams, {"ngrams": kinds, "drafter": bool(drafters), "retrieval": bool(idx)}
