"""Host overhead per decode step: everything a step costs besides the target's forward.

``redraft-bench --overhead`` decodes with a tiny random target (hidden 32, one layer: its
forward costs well under a millisecond on a CPU) so that what remains of a step is the
decoder's own work: drafting, tree building, acceptance, the cache commit, bookkeeping and
detokenisation. On a GPU serving a 7-8B target, whose forward costs 7-15 ms at batch 1, this is
the time the device waits for the host each step.

Per method and batch size it reports ``host_ms_per_step`` = (decode wall time - time inside
target forwards) / steps, ``forward_ms`` = the mean forward time per step of the same tiny
model (the tree sizes the method verified), best of ``repeats`` runs, and ``ops_per_step``: the
tensor ops a step dispatches outside the target forward (``redraft.infer.runner.opcount``; on a GPU
each is a kernel launch, so this is the figure that bounds host time there, and it is the same
on every machine). Methods:

* ``greedy``: plain decoding (no drafter);
* ``context-16`` / ``context-64``: the context n-gram drafter, fixed budgets of 16 / 64 nodes;
* ``ngrammys``: the N-Grammys mix (context matches + model-bigram chains), auto budget;
* ``mix-aded``: the N-Grammys mix plus ADED's MCTS over a tri-gram table, auto budget;
* ``redrafter``: a random one-layer ReDrafter head on the tiny target, width and length "auto"
  (its drafts are wrong, so a step is one beam search, one small tree, one token): the beam
  search's launches (replayed from a CUDA graph there), its planning and the tree built from
  its beams.

Rows ignore end-of-sequence tokens here so every run decodes exactly ``new_tokens`` tokens.
"""

from __future__ import annotations

import collections
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

OVERHEAD_METHODS = ("greedy", "context-16", "context-64", "ngrammys", "mix-aded", "redrafter")
_TEXT = (
    "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n"
    "Speculative decoding drafts tokens and the target verifies them in one pass. "
)


def tiny_setup(workdir: Path, device="cpu", dtype="float32"):
    """The tiny random target and n-gram tables built for it (model bigram and extended chains
    from its own weights, tri-grams counted over its own greedy continuations)."""
    from redraft.infer.decoder import plain_greedy
    from redraft.models import load_target
    from redraft.models.tiny import make_tiny_target_dir
    from redraft.ngrams import (
        NGramTables,
        build_bigram,
        build_extended,
        build_trigram_table,
        count_trigrams,
        save_tables,
    )

    target = load_target(
        str(make_tiny_target_dir(workdir / "target", hidden_size=32, num_layers=1)),
        dtype=dtype,
        device=device,
    )
    V = target.vocab_size
    bigram = build_bigram(target, k=8)
    extended = build_extended(bigram[0], w=4, k=8)
    docs = [
        np.asarray(g.tokens)
        for g in plain_greedy(
            target, [_TEXT[i : i + 60] for i in range(0, len(_TEXT) - 60, 15)], max_new_tokens=64
        )
    ]
    trigram = build_trigram_table(count_trigrams(docs, V), t=12)
    meta = dict(target.artifact_metadata(), vocab_size=V)
    save_tables(workdir / "ngrams", meta, bigram=bigram, extended=extended, trigram=trigram)
    return target, NGramTables.load(workdir / "ngrams", target=target, device=target.device)


class Timers:
    """Wall seconds spent in wrapped calls, summed per key (``dev/profile/step_phases.py``,
    ``dev/profile/long_join_steps.py``): ``wrap(obj, name, key)`` replaces ``obj.name`` (an instance
    or a class) by a timed version; ``take()`` returns the sums and starts again."""

    def __init__(self):
        self.t: dict[str, float] = collections.defaultdict(float)

    def wrap(self, obj, name: str, key: str | None = None) -> None:
        fn, key = getattr(obj, name), key or name

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[key] += time.perf_counter() - t0

        setattr(obj, name, timed)

    def take(self) -> dict:
        out, self.t = dict(self.t), collections.defaultdict(float)
        return out


def make_method(name: str, target, tables):
    """A :class:`SpeculativeDecoder` for one of :data:`OVERHEAD_METHODS`."""
    from redraft.infer.config import DecoderConfig
    from redraft.infer.decoder import SpeculativeDecoder
    from redraft.infer.drafters.ngram import ContextNGramDrafter
    from redraft.infer.loader import make_drafters

    # the speculative step's own cost is measured: the guard would swap some steps for plain ones
    cfg = DecoderConfig(guard=False)
    if name == "greedy":
        return SpeculativeDecoder(target, [], cfg, budget=0)
    if name.startswith("context-"):
        ctx = ContextNGramDrafter(
            target.vocab_size,
            q=cfg.context_q,
            q_max=cfg.context_q_max,
            k=cfg.ngram_k,
            w=cfg.ngram_w,
        )
        return SpeculativeDecoder(target, [ctx], cfg, budget=int(name.split("-")[1]))
    if name in ("ngrammys", "mix-aded"):
        cfg = cfg.replace(aded=name == "mix-aded")
        return SpeculativeDecoder(target, make_drafters(target, (), [tables], cfg), cfg)
    if name == "redrafter":
        from redraft.infer.drafters.redrafter.drafter import ReDrafterDrafter
        from redraft.models.redrafter import ReDrafter, ReDrafterConfig

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            head = ReDrafter(ReDrafterConfig.for_target(target, num_layers=1))
        head = head.to(target.device).eval().attach_target(target)
        return SpeculativeDecoder(target, [ReDrafterDrafter(head)], cfg)
    raise ValueError(f"unknown overhead method {name!r}; use one of {OVERHEAD_METHODS}")


def _prompts(target, batch: int) -> list[list[int]]:
    ids = target.tokenizer(_TEXT * 2, add_special_tokens=False)["input_ids"]
    return [ids[i * 7 % 40 : i * 7 % 40 + 64] for i in range(batch)]


@torch.no_grad()
def ops_per_step(decoder, prompts: list[list[int]], steps: int = 8) -> float:
    """Mean tensor ops per decode step outside the target forward (after the join and a warm-up
    step), over ``steps`` steps."""
    from redraft.infer.config import SamplingParams
    from redraft.infer.runner.opcount import OpCounter

    decoder.eos = set()
    engine = decoder.engine()
    for p in prompts:
        engine.add(
            p, SamplingParams.checked(max_new_tokens=16 * (steps + 2))
        )  # every row decodes throughout
    engine.step()
    engine.step()
    with OpCounter() as ops:
        for _ in range(steps):
            engine.step()
    return ops.total / steps


def _captures(decoder) -> int:
    return decoder.verifier.graph_stats["captures"]


@torch.no_grad()
def measure(decoder, prompts: list[list[int]], new_tokens: int) -> dict:
    """One decode of ``prompts``: wall seconds, seconds inside forwards, engine steps."""
    from redraft.infer.config import SamplingParams

    decoder.eos = set()
    v = decoder.verifier
    v.timing, v.forward_seconds = True, 0.0
    engine = decoder.engine()
    params = SamplingParams.checked(max_new_tokens=new_tokens)
    for p in prompts:
        engine.add(p, params)
    c0, t0 = _captures(decoder), time.perf_counter()
    while engine.has_work:
        engine.step()
    v.sync()
    wall = time.perf_counter() - t0
    v.timing = False
    # CUDA graph captures in the timed decode (a tree size seen for the first time): their
    # forwards count as host time and their ops as the step's (on a GPU that
    # more than doubled the ops and tripled the host time a step of a short run reads)
    return {
        "wall_s": wall,
        "forward_s": v.forward_seconds,
        "steps": engine.steps,
        "captures": _captures(decoder) - c0,
    }


def overhead_benchmark(
    device="cpu",
    dtype="float32",
    batches=(1, 8),
    new_tokens: int = 200,
    repeats: int = 3,
    methods=OVERHEAD_METHODS,
    progress=print,
    kernels=("jit",),
) -> dict:
    """``{"overhead": {method: {"batch_B": {"host_ms_per_step", "forward_ms", "steps"}}},
    "host_kernels": ...}``. ``kernels``: the host kernels each method runs with, ``"jit"`` (the
    compiled ones of :mod:`redraft.infer.spec.hostjit`) and/or ``"numpy"`` (rows ``"<method>
    (numpy)"``), one after the other per method and batch: the baseline in the same run."""
    from redraft.infer.spec import hostjit

    out, was = {}, hostjit.ENABLED
    if "jit" in kernels and not was:
        progress(f"[overhead] compiled host kernels unavailable ({hostjit.status()}): numpy rows")
        kernels = ("numpy",)
    runs = [(name, k) for name in methods for k in kernels]
    try:
        _overhead_runs(out, runs, batches, device, dtype, new_tokens, repeats, progress, was)
    finally:
        hostjit.ENABLED = was
    return {"overhead": out, "host_kernels": hostjit.status()}


def _overhead_runs(out, runs, batches, device, dtype, new_tokens, repeats, progress, jit) -> None:
    from redraft.infer.spec import hostjit

    with tempfile.TemporaryDirectory(prefix="redraft-overhead-") as tmp:
        target, tables = tiny_setup(Path(tmp), device, dtype)
        for name, kernel in runs:
            key = name if kernel == "jit" else f"{name} (numpy)"
            for B in batches:
                hostjit.ENABLED = jit and kernel == "jit"
                dec = make_method(name, target, tables)
                prompts = _prompts(target, B)
                measure(
                    dec, prompts, min(new_tokens, 16)
                )  # warm-up: allocator, cost curve, kernels
                best = min(
                    (measure(dec, prompts, new_tokens) for _ in range(repeats)),
                    key=lambda r: r["wall_s"] - r["forward_s"],
                )
                steps = max(best["steps"], 1)
                row = {
                    "host_ms_per_step": round(
                        1e3 * (best["wall_s"] - best["forward_s"]) / steps, 3
                    ),
                    "forward_ms": round(1e3 * best["forward_s"] / (steps + 1), 3),
                    "steps": best["steps"],
                    "tokens_per_step": round(B * new_tokens / steps, 3),
                }
                c0 = _captures(dec)
                row["ops_per_step"] = round(ops_per_step(dec, prompts), 1)
                row["captures"] = best["captures"]
                row["captures_in_ops"] = _captures(dec) - c0
                out.setdefault(key, {})[f"batch_{B}"] = row
                progress(
                    f"[overhead] {key:20s} batch {B}: host {row['host_ms_per_step']:.2f} ms/step, "
                    f"{row['ops_per_step']:.0f} ops/step, forward {row['forward_ms']:.2f} ms, {row['steps']} steps"
                )


def overhead_markdown(result: dict, device: str) -> str:
    rows = result["overhead"]
    batches = sorted({b for r in rows.values() for b in r}, key=lambda b: int(b.split("_")[1]))
    head = (
        "| method | "
        + " | ".join(
            f"host ms/step ({b.replace('_', ' ')}) | ops/step ({b.replace('_', ' ')}) | "
            f"forward ms ({b.replace('_', ' ')})"
            for b in batches
        )
        + " |"
    )
    lines = [
        f"Host overhead per decode step, tiny random target (hidden 32, 1 layer), {device}; "
        f"host kernels: {result.get('host_kernels', 'numpy')}.",
        "",
        head,
        "|---|" + "---:|---:|---:|" * len(batches),
    ]
    for name, r in rows.items():
        cells = [
            f"{r[b]['host_ms_per_step']:.2f} | {r[b].get('ops_per_step', float('nan')):.0f} | "
            f"{r[b]['forward_ms']:.2f}"
            if b in r
            else "- | - | -"
            for b in batches
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
