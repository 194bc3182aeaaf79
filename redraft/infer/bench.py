"""``redraft-bench``: decoding methods side by side, in one run, on the same prompts.

    redraft-bench --recipe infer/bench-default.yaml
    redraft-bench --target default --datasets chat,code --prompts 20 --methods greedy,hf-prompt-lookup,ngrammys,mix \\
        --ngrams checkpoints/ngrams-smollm2 --drafter checkpoints/redrafter-smollm2 --out bench.json --report bench/
    redraft-bench --overhead --out overhead.json        # host time per decode step (tiny target)

Every method decodes every prompt; prompts are the outer loop so machine noise hits all methods
alike, and every figure is reported against plain greedy (ours) measured in the same run:
``tokens_per_call`` (tau, prefill included), ``mean_accepted_length`` (vLLM / Spec-Bench:
accepted draft tokens + 1 per verify step), ``acceptance_per_position``, ``tokens_per_s``,
``speedup_vs_ar`` and ``identical_to_ar`` (the output equals plain greedy token for token).

Methods come from one explicit registry (``--list-methods`` prints it with what each needs); a
requested method that cannot run (a missing artifact, a table without the kind it needs) is an
error before any work. Decoder settings are :class:`~redraft.infer.config.DecoderConfig`
fields: each is a recipe key and a flag.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from redraft.errors import ConfigError, DataError, RedraftError
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

MT_BENCH_HINT = ("MT-Bench's questions are FastChat's fastchat/llm_judge/data/mt_bench/question.jsonl (80 lines); "
                 "download it and pass --datasets mt-bench:PATH.")


# ---------------------------------------------------------------------------------- prompts


def load_prompts(dataset: str, n: int, chat_spec: str = "default-chat") -> list:
    """Prompts of a dataset: "chat" (held-out ShareGPT, chat messages), "code" (HumanEval, plain
    text to complete), "mt-bench:PATH" (the first turns of MT-Bench's ``question.jsonl``) or a
    JSONL file (lines with "messages", "prompt" or "text")."""
    if dataset == "chat":
        from redraft.data.prompts import heldout_prompts

        return heldout_prompts(chat_spec, n=n)
    if dataset == "code":
        from redraft.data.prompts import humaneval_prompts

        return humaneval_prompts(n)
    if dataset.startswith("mt-bench"):
        path = Path(dataset.partition(":")[2])
        if not dataset.partition(":")[2] or not path.is_file():
            raise DataError(f"MT-Bench questions file {str(path) or '(none given)'!r} does not exist. {MT_BENCH_HINT}")
        return [[{"role": "user", "content": rec["turns"][0]}] for rec in _jsonl(path, ("turns",))][:n]
    path = Path(dataset)
    if not path.is_file():
        raise DataError(f"dataset {dataset!r} is neither 'chat', 'code', 'mt-bench:PATH' nor an existing JSONL file.")
    out = []
    for rec in _jsonl(path, ("messages", "prompt", "text")):
        out.append(rec.get("messages") or rec.get("prompt") or rec.get("text"))
        if len(out) >= n:
            break
    return out


def _jsonl(path: Path, keys: tuple[str, ...]) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{i} is not JSON ({exc}); each line must be an object with one of "
                                f"{list(keys)}.") from exc
            ok = isinstance(rec, dict) and any(
                isinstance(rec.get(k), str) and rec[k] or isinstance(rec.get(k), list) and rec[k] for k in keys)
            if not ok:
                raise DataError(f"{path}:{i} has none of {list(keys)} (a non-empty string or list).")
            out.append(rec)
    if not out:
        raise DataError(f"{path} holds no prompts.")
    return out


# ---------------------------------------------------------------------------------- the registry


@dataclass
class Method:
    """A benchmark method: what it needs and how to build its drafters.

    ``needs``: ``"ngrams:<kind>"`` (an n-gram table set holding that kind), ``"drafter"`` (a
    ReDrafter artifact) or ``"retrieval"`` (a draftretriever index). ``build(ctx)`` returns the
    drafters of a :class:`SpeculativeDecoder`, or the string ``"hf"`` for transformers' own
    ``generate`` (``hf_kwargs`` its extra arguments).
    """

    help: str
    build: Callable
    needs: tuple[str, ...] = ()
    hf_kwargs: Callable | None = None


def _ngram_table(ctx, kind):
    return next(t for t in ctx.tables if kind in t.kinds)


def _hierarchy(ctx, **kw):
    from redraft.infer.drafters.hsddw import default_hierarchy

    return default_hierarchy(ctx.target, **kw)


def _registry() -> dict[str, Method]:
    from redraft.infer.drafters.ngram import ContextNGramDrafter, NGrammysDrafter, TableDrafter
    from redraft.infer.loader import make_drafters

    def ctx_drafter(ctx):
        c = ctx.cfg
        return [ContextNGramDrafter(ctx.target.vocab_size, q=c.context_q, q_max=c.context_q_max, k=c.ngram_k,
                                    w=c.ngram_w)]

    def aded(ctx):
        from redraft.infer.drafters.aded import ADEDDrafter

        return [ADEDDrafter(_ngram_table(ctx, "trigram"))]

    def retrieval(ctx):
        from redraft.infer.drafters.retrieval import DraftRetrieverDrafter

        return [DraftRetrieverDrafter(ctx.retrieval_index)]

    c = lambda ctx: ctx.cfg  # noqa: E731
    return {
        "greedy": Method("plain autoregressive greedy decoding, our loop and cache (the baseline)", lambda ctx: []),
        "hf-greedy": Method("transformers generate, greedy", lambda ctx: "hf"),
        "hf-prompt-lookup": Method("transformers prompt lookup decoding (prompt_lookup_num_tokens)", lambda ctx: "hf",
                                   hf_kwargs=lambda ctx: {"prompt_lookup_num_tokens": ctx.bench["prompt_lookup_num_tokens"]}),
        "context": Method("context n-gram matches (prompt and output so far)", ctx_drafter),
        "bigram": Method("model bigram rows", lambda ctx: [TableDrafter(_ngram_table(ctx, "bigram"), "bigram",
                                                                          k=c(ctx).ngram_k)], ("ngrams:bigram",)),
        "extended": Method("extended model-bigram chains", lambda ctx: [TableDrafter(
            _ngram_table(ctx, "extended"), "extended", k=c(ctx).ngram_k, w=c(ctx).ngram_w)], ("ngrams:extended",)),
        "ngrammys": Method("N-Grammys: context matches, then extended model-bigram chains", lambda ctx: [NGrammysDrafter(
            _ngram_table(ctx, "extended"), ctx.target.vocab_size, k=c(ctx).ngram_k, w=c(ctx).ngram_w, q=c(ctx).context_q,
            q_max=c(ctx).context_q_max)], ("ngrams:extended",)),
        "redrafter": Method("the ReDrafter head(s) alone (beam search)", lambda ctx: list(ctx.heads), ("drafter",)),
        "aded": Method("ADED: MCTS over the corpus tri-gram table, adapted per request", aded, ("ngrams:trigram",)),
        "hsddw": Method("HSDDW: early-exit M1 -> early-exit M2 -> target, entropy self-verify",
                        lambda ctx: [_hierarchy(ctx)]),
        "hsddw-m1": Method("HSDDW's M1 (early exit) with self-verify alone", lambda ctx: [_hierarchy(ctx, m2_layers=10 ** 6)]),
        "draftretriever": Method("REST's suffix retriever (draftretriever) over --retrieval-index", retrieval,
                                 ("retrieval",)),
        "mix": Method("the unified mix over every given artifact (what load_decoder builds)",
                      lambda ctx: make_drafters(ctx.target, ctx.heads, ctx.tables, ctx.cfg)),
        "mix+aded": Method("the mix plus ADED over every table set with tri-grams", lambda ctx: make_drafters(
            ctx.target, ctx.heads, ctx.tables, ctx.cfg.replace(aded=True)), ("ngrams:trigram",)),
        "mix+hsddw": Method("the mix plus the HSDDW early-exit hierarchy", lambda ctx: make_drafters(
            ctx.target, ctx.heads, ctx.tables, ctx.cfg) + [_hierarchy(ctx)]),
    }


METHOD_NAMES = ("greedy", "hf-greedy", "hf-prompt-lookup", "context", "bigram", "extended", "ngrammys", "redrafter",
                "aded", "hsddw", "hsddw-m1", "draftretriever", "mix", "mix+aded", "mix+hsddw")


def check_methods(methods: list[str], have: dict) -> None:
    """Refuse (before any work) a method that is unknown or whose needs are missing.
    ``have``: ``{"ngrams": {kind, ...}, "drafter": bool, "retrieval": bool}``."""
    registry = _registry()
    for m in methods:
        if m not in registry:
            raise ConfigError(f"--methods: unknown method {m!r}; available: {', '.join(METHOD_NAMES)} "
                              f"(redraft-bench --list-methods says what each needs).", param="methods")
        for need in registry[m].needs:
            kind = need.partition(":")[2]
            ok = kind in have["ngrams"] if kind else bool(have[need])
            if not ok:
                how = {"drafter": "pass --drafter DIR (a redraft-train output)",
                       "retrieval": "pass --retrieval-index PATH (a draftretriever index)"}.get(
                    need, f"pass --ngrams DIR with a {kind!r} table (redraft-build-ngrams --kinds {kind} ...)")
                raise ConfigError(f"method {m!r} needs {need}: {how}.", param="methods")


# ---------------------------------------------------------------------------------- running


@dataclass
class Context:
    """What methods are built from: the target, loaded artifacts, the decoder settings."""

    target: object
    tables: list
    heads: list
    cfg: DecoderConfig
    bench: dict
    retrieval_index: str | None = None


class Runner:
    """One method, ready to decode: ``run(ids) -> (new token ids, RequestStats or None)``."""

    def __init__(self, name: str, ctx: Context, method: Method):
        from redraft.infer.decoder import SpeculativeDecoder

        self.name, self.ctx = name, ctx
        built = method.build(ctx)
        self.decoder = None
        if built == "hf":
            self.hf_kwargs = method.hf_kwargs(ctx) if method.hf_kwargs else {}
        else:
            cfg = ctx.cfg if built else ctx.cfg.replace(budget=0)
            self.decoder = SpeculativeDecoder(ctx.target, built, cfg)

    def run(self, ids: list[int]):
        n = self.ctx.bench["max_new_tokens"]
        if self.decoder is not None:
            g = self.decoder.generate([ids], max_new_tokens=n)[0]
            return g.tokens, g.stats
        import torch

        target = self.ctx.target
        x = torch.tensor([ids], device=target.device)
        eos = target.eos_token_ids
        with torch.no_grad():
            out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                        eos_token_id=eos, pad_token_id=eos[0], **self.hf_kwargs)
        return out[0, len(ids):].tolist(), None


def run_dataset(runners: dict, prompts: list[list[int]], bench: dict, label: str) -> dict:
    """Decode every prompt with every method (prompt-major); returns per-method aggregates."""
    from collections import Counter

    from tqdm.auto import tqdm

    from redraft.infer.stats import RequestStats

    agg = {m: {"time": 0.0, "tokens": 0, "identical": 0, "stats": RequestStats(target_calls=0), "hf": False}
           for m in runners}
    if bench["warmup"]:
        for r in runners.values():
            r.run(prompts[0][:32])
    for ids in tqdm(prompts, desc=f"bench {label}", unit="prompt"):
        ref = None
        for name, r in runners.items():
            t0 = time.perf_counter()
            toks, st = r.run(ids)
            dt = time.perf_counter() - t0
            a = agg[name]
            a["time"] += dt
            a["tokens"] += len(toks)
            ref = toks if name == "greedy" else ref
            a["identical"] += int(toks == ref)
            if st is None:
                a["hf"] = True
                continue
            s = a["stats"]
            s.new_tokens += st.new_tokens
            s.target_calls += st.target_calls
            s.accepted_hist.update(st.accepted_hist)
            s.drafter_accepted.update(st.drafter_accepted)
            s.draft_time += st.draft_time
            s.verify_time += st.verify_time
            s.tree_nodes += st.tree_nodes
    base_tps = agg["greedy"]["tokens"] / max(agg["greedy"]["time"], 1e-9)
    res = {}
    for name, a in agg.items():
        s, tps = a["stats"], a["tokens"] / max(a["time"], 1e-9)
        steps = s.verify_steps
        res[name] = {
            "tokens_per_call": None if a["hf"] else round(s.tokens_per_call, 3),
            "mean_accepted_length": None if a["hf"] else round(s.mean_accepted_length, 3),
            "acceptance_per_position": [] if a["hf"] else [round(x, 3) for x in s.acceptance_per_position()],
            "tokens_per_s": round(tps, 2),
            "speedup_vs_ar": round(tps / base_tps, 3),
            "identical_to_ar": a["identical"] == len(prompts),
            "identical_prompts": f"{a['identical']}/{len(prompts)}",
            "new_tokens": a["tokens"],
            "time_s": round(a["time"], 2),
            "draft_time_s": round(s.draft_time, 2),
            "verify_time_s": round(s.verify_time, 2),
            "tree_nodes_per_step": round(s.tree_nodes / steps, 2) if steps else 0.0,
            "accepted_hist": {int(k): v for k, v in sorted(Counter(s.accepted_hist).items())},
            "drafter_share": {k: round(v, 3) for k, v in s.drafter_share().items()},
        }
    return res


def markdown(results: dict, bench: dict, device: str) -> str:
    lines = [f"redraft-bench: target {bench['target']} ({bench['dtype']}), {device}, greedy, "
             f"{bench['max_new_tokens']} new tokens; speedup vs plain greedy (ours) in the same run. tau = new "
             f"tokens per target call (prefill included); MAL = mean accepted length (accepted draft tokens + 1 "
             f"per verify step, vLLM / Spec-Bench).", ""]
    for ds, res in results.items():
        lines += [f"### {ds}", "", "| method | tau | MAL | tokens/s | speedup vs AR | identical to AR |",
                  "|---|---:|---:|---:|---:|:---:|"]
        for name, r in res.items():
            tau = "-" if r["tokens_per_call"] is None else f"{r['tokens_per_call']:.2f}"
            mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
            lines.append(f"| {name} | {tau} | {mal} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | "
                         f"{'yes' if r['identical_to_ar'] else 'no'} ({r['identical_prompts']}) |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- configuration


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="redraft-bench", description=__doc__.split("\n\n")[0],
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


def _artifacts(bench: dict) -> tuple[list[Path], list[Path], dict]:
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


def _write(path, text: str) -> None:
    from redraft.utils import atomic_write_text

    atomic_write_text(path, text)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        bench, cfg = resolve_config(args)
        if args.list_methods:
            for name, m in _registry().items():
                print(f"{name:18s} {m.help}" + (f"  [needs {', '.join(m.needs)}]" if m.needs else ""))
            return 0
        check_outputs(bench)
        if args.from_json:
            return _from_json(Path(args.from_json), bench)
        from redraft.utils import resolve_device

        device = resolve_device(bench["device"])
        import torch

        if bench["threads"]:
            torch.set_num_threads(int(bench["threads"]))
        if bench["overhead"]:
            return _overhead(bench, device)
        methods = list(dict.fromkeys(["greedy"] + bench["methods"]))
        drafter_dirs, ngram_dirs, have = _artifacts(bench)
        check_methods(methods, have)
        from redraft.infer.loader import load_ngram_tables, load_redrafter
        from redraft.models import load_target

        target = load_target(bench["target"], dtype=bench["dtype"], device=device)
        tables = [load_ngram_tables(p, target) for p in ngram_dirs]
        heads = [load_redrafter(p, target, cfg.redrafter_width, cfg.redrafter_length,
                                name="redrafter" if len(drafter_dirs) == 1 else f"redrafter{i}")
                 for i, p in enumerate(drafter_dirs)]
        ctx = Context(target, tables, heads, cfg, bench, bench["retrieval_index"])
        registry = _registry()
        runners = {m: Runner(m, ctx, registry[m]) for m in methods}
        costs = _cost_curve(runners, bench)
        desc = (torch.cuda.get_device_name(target.device) if target.device.type == "cuda"
                else f"CPU {_cpu_name()}, {torch.get_num_threads()} threads")
        results = {}
        for ds in bench["datasets"]:
            prompts = [runners["greedy"].decoder.encode(p)[0] for p in load_prompts(ds, bench["prompts"], bench["chat_spec"])]
            results[_label(ds)] = run_dataset(runners, prompts, bench, ds)
        md = markdown(results, bench, desc)
        print(md)
        report = {"config": {**bench, "decoder": cfg.to_dict()}, "device": desc, "torch": torch.__version__,
                  "cost_curve_ms": costs, "results": results}
        _outputs(report, md, bench)
        return 0
    except KeyboardInterrupt:
        print("redraft-bench: interrupted", file=sys.stderr)
        return 130
    except RedraftError as exc:
        print(f"redraft-bench: error: {exc}", file=sys.stderr)
        return 2


def _label(ds: str) -> str:
    if ds in ("chat", "code"):
        return ds
    if ds.startswith("mt-bench"):
        return "mt-bench"
    return Path(ds).stem


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _cost_curve(runners: dict, bench: dict) -> dict:
    """One verify-cost curve for every method of the run (measured once, or given)."""
    from redraft.infer.budget import CostCurve

    curve = CostCurve.from_ms(bench["cost_curve_ms"]) if bench["cost_curve_ms"] else None
    for r in runners.values():
        dec = r.decoder
        if dec is not None and dec.drafters and dec.config.budget == "auto":
            curve = curve or dec.measure_cost()
            dec.cost_curve = curve
    return {} if curve is None else {**curve.to_dict(), "given": bool(bench["cost_curve_ms"])}


def _outputs(report: dict, md: str, bench: dict) -> None:
    if bench["out"]:
        _write(bench["out"], json.dumps(report, indent=2))
    if bench["markdown"]:
        _write(bench["markdown"], md)
    if bench["report"]:
        from redraft.infer.report import write_report

        index = write_report(report, bench["report"])
        print(f"report: {index}")


def _from_json(path: Path, bench: dict) -> int:
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--from-json {path}: cannot read it ({exc}).", param="from_json") from exc
    if "results" not in report and "overhead" not in report:
        raise ConfigError(f"--from-json {path} is not a redraft-bench --out file (no 'results' or 'overhead').")
    md = markdown(report["results"], {**bench, **report.get("config", {})}, report.get("device", "?")) \
        if "results" in report else ""
    _outputs(report, md, {**bench, "out": None})
    return 0


def _overhead(bench: dict, device) -> int:
    from redraft.infer.overhead import overhead_benchmark, overhead_markdown

    result = overhead_benchmark(device=device, dtype=bench["dtype"], batches=bench["overhead_batches"],
                                new_tokens=bench["overhead_tokens"])
    import torch

    desc = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"CPU {_cpu_name()}, {torch.get_num_threads()} threads")
    result.update(device=desc, torch=torch.__version__, config={"dtype": bench["dtype"],
                                                                 "new_tokens": bench["overhead_tokens"]})
    md = overhead_markdown(result, desc)
    print(md)
    _outputs(result, md, bench)
    return 0


if __name__ == "__main__":
    sys.exit(main())
