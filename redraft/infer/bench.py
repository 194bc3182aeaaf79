"""``redraft-bench``: decoding methods side by side, in one run, on the same prompts.

    redraft-bench --recipe infer/bench-default.yaml
    redraft-bench --target default --datasets chat,code --prompts 20 --methods greedy,hf-prompt-lookup,ngrammys,mix \
        --ngrams checkpoints/ngrams-smollm2 --drafter checkpoints/redrafter-smollm2 --out bench.json

Every method decodes every prompt; prompts are the outer loop so machine noise hits all methods
alike, and every figure is reported against plain greedy (ours) measured in the same run:
``tokens_per_call`` (tau), ``tokens_per_s``, ``speedup_vs_ar`` and ``identical_to_ar`` (the
output equals plain greedy token for token on every prompt).

Methods are a registry (``--methods``, ``--list-methods``):

* ``greedy``: plain autoregressive greedy decoding, our loop and cache (the baseline);
* ``hf-greedy``: transformers ``generate`` greedy; ``hf-prompt-lookup``: transformers prompt
  lookup decoding (``prompt_lookup_num_tokens``);
* one per drafter alone: ``context``, ``bigram``, ``extended``, ``ngrammys`` (n-gram tables),
  ``redrafter`` (a trained head);
* ``mix``: all available drafters in one tree;
* methods contributed by modules that define ``bench_methods(target=..., table=..., mix=...)``
  returning ``{name: [drafters]}`` (``redraft.infer.aded``, ``redraft.infer.hsddw``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

from redraft.errors import ConfigError, DataError, RedraftError

logger = logging.getLogger(__name__)

PLUGIN_MODULES = ("redraft.infer.aded", "redraft.infer.hsddw")
DEFAULTS = {
    "target": "default", "dtype": "float32", "device": None, "datasets": ["chat", "code"], "prompts": 20,
    "max_new_tokens": 128, "methods": ["greedy", "hf-greedy", "hf-prompt-lookup", "context", "ngrammys",
                                       "redrafter", "mix"],
    "drafters": [], "ngrams": [], "budget": "auto", "max_nodes": 64, "fp32_logits": False,
    "prompt_lookup_num_tokens": 10, "out": None, "markdown": None, "threads": None, "warmup": True,
    "chat_spec": "default-chat", "cost_curve_ms": None, "redrafter_width": 8, "redrafter_length": None, "ngram_k": 8, "ngram_w": 12,
    "context_q": 1, "context_q_max": 3,
}


# ---------------------------------------------------------------------------------- prompts


def load_prompts(dataset: str, n: int, chat_spec: str = "default-chat") -> list:
    """Prompts of a dataset: "chat" (held-out ShareGPT, chat messages), "code" (HumanEval,
    plain text to complete) or a JSONL file (lines with "messages", "prompt" or "text")."""
    if dataset == "chat":
        from redraft.data.prompts import heldout_prompts

        return heldout_prompts(chat_spec, n=n)
    if dataset == "code":
        from redraft.data.prompts import humaneval_prompts

        return humaneval_prompts(n)
    path = Path(dataset)
    if not path.is_file():
        raise ConfigError(f"dataset {dataset!r} is neither 'chat', 'code' nor an existing JSONL file.")
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{i} is not JSON ({exc}); each line must be an object with "
                                f"'messages', 'prompt' or 'text'.") from exc
            if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
                out.append(rec["messages"])
            elif isinstance(rec, dict) and isinstance(rec.get("prompt", rec.get("text")), str):
                out.append(rec.get("prompt", rec.get("text")))
            elif isinstance(rec, str):
                out.append(rec)
            else:
                raise DataError(f"{path}:{i} has none of 'messages' (list), 'prompt' or 'text' (string).")
            if len(out) >= n:
                break
    if not out:
        raise DataError(f"{path} holds no prompts.")
    return out


# ---------------------------------------------------------------------------------- methods


class Method:
    """A benchmark method: ``run(ids) -> (new token ids, target forwards or None)``."""

    def __init__(self, name, run, decoder=None):
        self.name, self.run, self.decoder = name, run, decoder


def decoder_method(name, target, drafters, cfg) -> Method:
    from redraft.infer.decoder import SpeculativeDecoder

    dec = SpeculativeDecoder(target, drafters, budget=cfg["budget"] if drafters else 0,
                             max_nodes=cfg["max_nodes"], fp32_logits=cfg["fp32_logits"])

    def run(ids):
        g = dec.generate(ids, max_new_tokens=cfg["max_new_tokens"])[0]
        return g.tokens, g.stats
    return Method(name, run, dec)


def hf_method(name, target, cfg, **gen_kwargs) -> Method:
    model = target.model
    eos = target.eos_token_ids

    @torch.no_grad()
    def run(ids):
        x = torch.tensor([ids], device=target.device)
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=cfg["max_new_tokens"],
                             do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **gen_kwargs)
        toks = out[0, len(ids):].tolist()
        return toks, None
    return Method(name, run)


def build_methods(target, cfg) -> dict:
    """Name -> Method for every requested method that its artifacts allow (others are skipped
    with a warning naming what is missing)."""
    from redraft.infer.drafters.ngram import ContextNGramDrafter, NGrammysDrafter, TableDrafter
    from redraft.infer.loader import load_ngram_tables, load_redrafter, make_drafters

    V = target.vocab_size
    tables = [load_ngram_tables(p, target) for p in cfg["ngrams"]]
    heads = [load_redrafter(p, target, cfg["redrafter_width"], cfg["redrafter_length"],
                            name="redrafter" if len(cfg["drafters"]) == 1 else f"redrafter{i}")
             for i, p in enumerate(cfg["drafters"])]
    k, w, q, q_max = cfg["ngram_k"], cfg["ngram_w"], cfg["context_q"], cfg["context_q_max"]
    table = tables[0] if tables else None
    kinds = set(getattr(table, "kinds", [])) if table is not None else set()
    singles = {"context": lambda: [ContextNGramDrafter(V, q=q, q_max=q_max, k=k, w=w)]}
    if "bigram" in kinds:
        singles["bigram"] = lambda: [TableDrafter(table, "bigram", k=k)]
    if "extended" in kinds:
        singles["extended"] = lambda: [TableDrafter(table, "extended", k=k, w=w)]
        singles["ngrammys"] = lambda: [NGrammysDrafter(table, V, k=k, w=w, q=q, q_max=q_max)]
    if heads:
        singles["redrafter"] = lambda: list(heads)

    def mix():  # exactly what load_decoder builds from the same artifacts
        return make_drafters(target, heads, tables, ngram_k=k, ngram_w=w, context_q=q, context_q_max=q_max)

    registry = {
        "greedy": lambda: decoder_method("greedy", target, [], cfg),
        "hf-greedy": lambda: hf_method("hf-greedy", target, cfg),
        "hf-prompt-lookup": lambda: hf_method("hf-prompt-lookup", target, cfg,
                                              prompt_lookup_num_tokens=cfg["prompt_lookup_num_tokens"]),
        "mix": lambda: decoder_method("mix", target, mix(), cfg),
    }
    for name, make in singles.items():
        registry[name] = (lambda n=name, m=make: decoder_method(n, target, m(), cfg))
    for mod_name in PLUGIN_MODULES:  # methods other modules contribute
        try:
            mod = __import__(mod_name, fromlist=["bench_methods"])
        except Exception as exc:  # an optional provider that cannot import is skipped
            logger.warning("bench: %s not available (%s)", mod_name, exc)
            continue
        fn = getattr(mod, "bench_methods", None)
        if fn is None:
            continue
        # `table`: the first n-gram tables holding tri-grams (what ADED drafts from), else None
        tri = next((t for t in tables if "trigram" in getattr(t, "kinds", [])), None)
        offered = {"target": target, "table": tri, "mix": mix(), "tables": tables, "cfg": cfg}
        params = inspect.signature(fn).parameters
        kwargs = {k: v for k, v in offered.items() if k in params}
        try:
            extra = fn(**kwargs) or {}
        except Exception as exc:
            logger.warning("bench: %s.bench_methods failed (%s)", mod_name, exc)
            continue
        for name, drafters in extra.items():
            registry.setdefault(name, (lambda n=name, d=drafters: decoder_method(n, target, list(d), cfg)))
    if cfg.get("list_methods"):
        return registry
    out = {}
    for name in cfg["methods"]:
        if name not in registry:
            print(f"[bench] skipping {name!r}: not available (have {sorted(registry)}); "
                  f"n-gram methods need --ngrams DIR, redrafter needs --drafter DIR", file=sys.stderr)
            continue
        out[name] = registry[name]()
    if "greedy" not in out:
        out = {"greedy": registry["greedy"](), **out}
    return out


# ---------------------------------------------------------------------------------- running


def run_dataset(target, methods: dict, prompts: list, cfg, label: str) -> dict:
    """Decode every prompt with every method (prompt-major); returns per-method aggregates."""
    from tqdm import tqdm

    ids_list = [methods["greedy"].decoder.encode(p)[0] for p in prompts]
    agg = {m: {"time": 0.0, "tokens": 0, "calls": 0, "identical": 0, "has_calls": True, "hist": {},
               "share": {}, "draft_time": 0.0, "verify_time": 0.0} for m in methods}
    if cfg["warmup"]:
        for m in methods.values():
            m.run(ids_list[0][:32])
    for ids in tqdm(ids_list, desc=f"bench {label}", unit="prompt"):
        ref = None
        for name, m in methods.items():
            t0 = time.perf_counter()
            toks, st = m.run(ids)
            dt = time.perf_counter() - t0
            a = agg[name]
            a["time"] += dt
            a["tokens"] += len(toks)
            if name == "greedy":
                ref = toks
            a["identical"] += int(toks == ref)
            if st is None:
                a["has_calls"] = False
            else:
                a["calls"] += st.target_calls
                a["draft_time"] += st.draft_time
                a["verify_time"] += st.verify_time
                for k_, v in st.accepted_hist.items():
                    a["hist"][k_] = a["hist"].get(k_, 0) + v
                for k_, v in st.drafter_accepted.items():
                    a["share"][k_] = a["share"].get(k_, 0) + v
    base_tps = agg["greedy"]["tokens"] / max(agg["greedy"]["time"], 1e-9)
    res = {}
    for name, a in agg.items():
        tps = a["tokens"] / max(a["time"], 1e-9)
        acc_total = sum(k_ * v for k_, v in a["hist"].items())
        res[name] = {
            "tokens_per_call": round(a["tokens"] / a["calls"], 3) if a["has_calls"] and a["calls"] else None,
            "tokens_per_s": round(tps, 2),
            "speedup_vs_ar": round(tps / base_tps, 3),
            "identical_to_ar": a["identical"] == len(prompts),
            "identical_prompts": f"{a['identical']}/{len(prompts)}",
            "new_tokens": a["tokens"],
            "time_s": round(a["time"], 2),
            "draft_time_s": round(a["draft_time"], 2),
            "verify_time_s": round(a["verify_time"], 2),
            "accepted_hist": dict(sorted(a["hist"].items())),
            "drafter_share": {k_: round(v / max(acc_total, 1), 3) for k_, v in a["share"].items()},
        }
    return res


def markdown(results: dict, cfg, device: str) -> str:
    lines = [f"redraft-bench: target {cfg['target']} ({cfg['dtype']}), {device}, greedy, "
             f"{cfg['max_new_tokens']} new tokens; speedup vs plain greedy (ours) in the same run.", ""]
    for ds, res in results.items():
        lines += [f"### {ds}", "", "| method | tokens/call | tokens/s | speedup vs AR | identical to AR |",
                  "|---|---:|---:|---:|:---:|"]
        for name, r in res.items():
            tau = "-" if r["tokens_per_call"] is None else f"{r['tokens_per_call']:.2f}"
            lines.append(f"| {name} | {tau} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | "
                         f"{'yes' if r['identical_to_ar'] else 'no'} ({r['identical_prompts']}) |")
        lines.append("")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="redraft-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", help="YAML file with any of the settings below (flags override it)")
    p.add_argument("--target", help="target spec: 'default', hub id, local dir or .gguf (default: default)")
    p.add_argument("--dtype", help="target dtype: float32 or bfloat16 (default float32)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--datasets", help="comma list of 'chat' (held-out ShareGPT), 'code' (HumanEval) and "
                                      "JSONL files of prompts (default chat,code)")
    p.add_argument("--prompts", type=int, help="prompts per dataset (default 20)")
    p.add_argument("--max-new-tokens", type=int, help="new tokens per prompt (default 128)")
    p.add_argument("--methods", help="comma list of methods (see --list-methods)")
    p.add_argument("--list-methods", action="store_true", help="print the available methods and exit")
    p.add_argument("--drafter", action="append", help="ReDrafter artifact dir or hub id (repeatable)")
    p.add_argument("--ngrams", action="append", help="n-gram tables dir or hub id (repeatable)")
    p.add_argument("--ngram-k", type=int, help="n-gram draft rows per step (default 8)")
    p.add_argument("--ngram-w", type=int, help="tokens per context-match row (default 12)")
    p.add_argument("--context-q", type=int, help="shortest context match, in tokens (default 1)")
    p.add_argument("--context-q-max", type=int, help="longest context match tried first (default 3)")
    p.add_argument("--budget", help="tree nodes per verify: 'auto' (cost model) or a number (default auto)")
    p.add_argument("--max-nodes", type=int, help="upper bound on tree nodes for auto budget (default 64)")
    p.add_argument("--fp32-logits", action="store_true", default=None,
                   help="compute verify logits with a float32 LM head (for bf16 targets)")
    p.add_argument("--cost-curve", dest="cost_curve_ms",
                   help="verify cost curve to use instead of measuring one, 'tokens:ms,...' (e.g. "
                        "'1:63,8:116,16:146,64:245'); use it when the machine is too busy to measure")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up decode of each method")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--markdown", help="write the Markdown table here (it is also printed)")
    return p


def resolve_config(args) -> dict:
    cfg = dict(DEFAULTS)
    if args.recipe:
        import yaml

        from redraft.resources import find_config

        path = find_config(args.recipe, "infer")  # a file, or a shipped name such as bench-default
        rec = yaml.safe_load(path.read_text()) or {}
        unknown = sorted(set(rec) - set(DEFAULTS))
        if unknown:
            raise ConfigError(f"{path}: unknown keys {unknown}; valid: {sorted(DEFAULTS)}.")
        cfg.update(rec)
    flags = {"target": args.target, "dtype": args.dtype, "device": args.device, "prompts": args.prompts,
             "max_new_tokens": args.max_new_tokens, "max_nodes": args.max_nodes, "fp32_logits": args.fp32_logits,
             "threads": args.threads, "out": args.out, "markdown": args.markdown,
             "cost_curve_ms": args.cost_curve_ms, "ngram_k": args.ngram_k, "ngram_w": args.ngram_w,
             "context_q": args.context_q, "context_q_max": args.context_q_max}
    cfg.update({k: v for k, v in flags.items() if v is not None})
    if args.datasets:
        cfg["datasets"] = args.datasets.split(",")
    if args.methods:
        cfg["methods"] = args.methods.split(",")
    if args.drafter:
        cfg["drafters"] = args.drafter
    if args.ngrams:
        cfg["ngrams"] = args.ngrams
    if args.budget:
        cfg["budget"] = args.budget
    if args.no_warmup:
        cfg["warmup"] = False
    for key in ("datasets", "methods", "drafters", "ngrams"):
        if isinstance(cfg[key], str):
            cfg[key] = [s for s in cfg[key].split(",") if s]
    if cfg["budget"] != "auto":
        try:
            cfg["budget"] = int(cfg["budget"])
        except (TypeError, ValueError):
            raise ConfigError(f"budget {cfg['budget']!r}: use 'auto' or a number of nodes.") from None
    # artifacts named in a recipe but not built yet are skipped with a message, not an error
    for key in ("drafters", "ngrams"):
        keep = []
        for p in cfg[key]:
            if Path(p).exists() or "/" in p and not p.startswith((".", "/", "checkpoints")):
                keep.append(p)
            else:
                print(f"[bench] {key[:-1]} {p} not found; methods that need it are skipped", file=sys.stderr)
        cfg[key] = keep
    cfg["list_methods"] = args.list_methods
    return cfg


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = resolve_config(args)
        if cfg["threads"]:
            torch.set_num_threads(int(cfg["threads"]))
        from redraft.models import load_target

        target = load_target(cfg["target"], dtype=cfg["dtype"], device=cfg["device"])
        methods = build_methods(target, cfg)
        if cfg["list_methods"]:
            print("\n".join(sorted(methods)))
            return 0
        device = (torch.cuda.get_device_name(0) if target.device.type == "cuda"
                  else f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
        results, costs = {}, {}
        if cfg["cost_curve_ms"]:
            try:
                pts = [tuple(float(x) for x in kv.split(":")) for kv in str(cfg["cost_curve_ms"]).split(",")]
                costs = {"sizes": [int(n) for n, _ in pts], "ms": [ms for _, ms in pts], "given": True}
            except ValueError:
                raise ConfigError(f"cost curve {cfg['cost_curve_ms']!r}: write 'tokens:ms,...', "
                                  f"e.g. '1:63,8:116,16:146,64:245'.") from None
        for m in methods.values():
            if m.decoder is not None and m.decoder.drafters and m.decoder.budget == "auto":
                if not costs:
                    costs = m.decoder.measure_cost().to_dict()
                else:
                    from redraft.infer.budget import CostCurve

                    m.decoder.cost_curve = CostCurve(costs["sizes"], [x / 1e3 for x in costs["ms"]])
        for ds in cfg["datasets"]:
            prompts = load_prompts(ds, cfg["prompts"], cfg["chat_spec"])
            results[Path(ds).stem if ds not in ("chat", "code") else ds] = run_dataset(target, methods, prompts, cfg, ds)
        md = markdown(results, cfg, device)
        print(md)
        report = {"config": {k: v for k, v in cfg.items() if k != "list_methods"}, "device": device,
                  "torch": torch.__version__, "cost_curve_ms": costs, "results": results}
        if cfg["out"]:
            out = Path(cfg["out"])
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(out.suffix + ".tmp")
            tmp.write_text(json.dumps(report, indent=2))
            os.replace(tmp, out)
        if cfg["markdown"]:
            Path(cfg["markdown"]).write_text(md)
        return 0
    except RedraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
