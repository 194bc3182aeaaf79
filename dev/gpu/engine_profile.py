"""Where a batched engine step's time goes on one device: the verify forward by batch and cache
capacity, and a distillation-like engine run split into forward and host time.

    python dev/gpu/engine_profile.py --target default --device cuda --dtype bfloat16 \
        --out engine.json --markdown engine.md

Stage quick of ``dev/gpu/gpu-run.sh``. Why it exists: on a GPU the
engine distilled at 22.2 ms per decode step with a mean batch of 40.8 rows, while one row's
one-token verify replays in 3.45 ms. Two suspects, one part each:

1. **grid**: the one-token verify forward (the decoder's static verify, LM head included) of
   ``B`` rows, each holding ``--context`` tokens, in a cache of ``C`` columns, for B in
   ``--batches`` and C in ``--capacities``: a captured graph attends every row over the whole
   capacity, so if the forward grows with ``B x C`` the capacity is the cost. CUDA: graph
   replays (and the eager forward of the largest point); CPU: eager forwards.
2. **engine**: an :class:`~redraft.infer.replies.EngineReplies` (what ``redraft-distill-data``
   runs) with ``--batch`` random prompts of ``--prompt-tokens`` tokens and no stop id (every row
   decodes ``--max-new-tokens``): per step, its wall time, the synchronised forward time and
   the rest (host work: sampling, commit, detokenisation, events), with the cache's shape and
   the graph counts.

Both parts also run with ``span_buckets`` (``redraft.infer.runner.verify.Verifier.static_span``: a
captured verify attends over the power-of-two span holding the longest row, not the capacity):
the grid for the largest batch, the engine a second time; the engine runs a third time
speculating, as ``redraft-distill-data`` does by default. And the grid's largest batch verifies
a ``--tree``-token chain per row at every capacity twice: with redraft's attention (the query
heads of a key/value head packed into its rows, ``redraft.infer.runner.grouped_attention``) and with
transformers' ``sdpa``, which for a masked forward of more than one token copies the keys and
values once per query head (``repeat_kv``) in every layer: what packing saves on this device.

Output JSON: ``{"device", "torch", "target", "dtype", "context", "grid": [{"batch",
"capacity", "span", "buckets", "tree", "attention", "ms", "mode"}], "eager_ms": {...},
"engine": [{...}, ...]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gpu_profile import _best_ms  # the same timing (dev/gpu/ is the script's path)


def grid(
    target, batches, capacities, context: int, repeats: int, tree: int = 0
) -> tuple[list, dict]:
    """One-token verify ms for every ``(batch, capacity)`` attending over the whole capacity,
    and for the largest batch with ``span_buckets`` (the span that holds the rows); with
    ``tree``, a ``tree``-token chain per row for the largest batch at every capacity, with the
    query heads packed (redraft's attention) and with transformers' own ``sdpa`` (which copies
    the keys and values per query head for more than one query token); and the eager ms of the
    largest point."""
    import torch

    from redraft.infer.runner.grouped_attention import NAME
    from redraft.infer.runner.verify import Verifier, chain_step

    ver = Verifier(target, static=True)  # (switches the target to redraft's attention, NAME)
    cuda = ver.device.type == "cuda"
    rows, eager = [], {}
    top = max(batches)
    # (batch, capacity, span_buckets, tree tokens, attention implementation)
    points = [(B, C, False, 1, NAME) for C in capacities for B in batches]
    points += [(top, C, True, 1, NAME) for C in capacities]
    if tree > 1:
        points += [(top, C, False, tree, impl) for C in capacities for impl in (NAME, "sdpa")]
    for B, C, buckets, n, impl in points:
        ver.span_buckets = buckets
        if C < context + n + 1:
            continue
        if target.model.config._attn_implementation != impl:
            target.model.set_attn_implementation(impl)
        cache = ver.new_cache(B, C)
        with torch.inference_mode():
            ver.prefill([[0] * context] * B, cache)
            cache.batch, cache.host_lengths = B, [context] * B
            step = chain_step([context] * B, n, ver.device)

            def graph(step=step, cache=cache):
                ver.logits(ver.verify(step, cache))

            mode = "eager"
            if cuda:
                ver._last_key = None
                for _ in range(2):  # the second call in a row captures
                    graph()
                if any(k[:2] == (B, n) for k in cache.graph_set.entries):
                    mode = "replay"
            ms = _best_ms(graph, ver.sync, repeats)
            if B == top and C == max(capacities) and cuda and not buckets and n == 1:

                def run_eager(step=step, cache=cache):
                    ver.logits(ver._tree_forward(step, cache, static=True))

                eager = {"batch": B, "capacity": C, "ms": _best_ms(run_eager, ver.sync, 2)}
        span = ver.static_span(cache, n)
        rows.append(
            {
                "batch": B,
                "capacity": C,
                "span": span,
                "buckets": buckets,
                "tree": n,
                "attention": "packed" if impl == NAME else impl,
                "ms": ms,
                "mode": mode,
            }
        )
        print(f"grid: {rows[-1]}", flush=True)
        del cache, step
        if cuda:
            torch.cuda.empty_cache()
    target.model.set_attn_implementation(NAME)
    return rows, eager


def engine_run(
    target,
    batch: int,
    prompt_tokens: int,
    max_new: int,
    steps: int,
    buckets: bool = False,
    grow_to: int = 0,
    speculate: bool = False,
) -> dict:
    """An engine at ``batch`` rows of random prompts: wall, forward and host ms per step over
    ``steps`` steady steps (after every row has joined and a few warm-up steps); ``buckets``:
    its verifier's ``span_buckets``; ``grow_to``: a prompt of that many tokens passes through
    first (its cache columns stay); ``speculate``: the engine drafts as ``redraft-distill-data``
    does by default (``ReplySettings.speculate``; random prompts give prompt lookup little to
    find, so this times the drafting and guard overhead more than their gain)."""
    import torch

    from redraft.data.replies import ReplySettings
    from redraft.infer.replies import EngineReplies

    V = target.vocab_size
    g = torch.Generator().manual_seed(0)
    gen = EngineReplies(target, ReplySettings(max_new, (), batch_size=batch, speculate=speculate))
    if grow_to:  # one long request first, one token long: the cache keeps its columns (as a
        # distillation's cache keeps those of its longest prompt so far)
        gen.engine.add(
            torch.randint(3, V - 1, (grow_to,), generator=g).tolist(), {"max_new_tokens": 1}
        )
        while gen.engine.has_work:
            gen.engine.step()
    for k in range(batch):
        gen.submit(k, torch.randint(3, V - 1, (prompt_tokens,), generator=g).tolist())
    eng, ver = gen.engine, gen.decoder.verifier
    ver.span_buckets = buckets
    warm = 0
    while eng.has_work and (eng.prefilling or warm < 8):
        eng.step()
        warm += 0 if eng.prefilling else 1
    before = dict(ver.graph_stats)
    ver.timing, ver.forward_seconds = True, 0.0
    t0, n = time.perf_counter(), 0
    rows = 0
    while eng.has_work and n < steps:
        rows += eng.cache.batch
        eng.step()
        n += 1
    wall = time.perf_counter() - t0
    ver.timing = False
    fwd = ver.forward_seconds
    return {
        "span_buckets": buckets,
        "speculate": speculate,
        "steps": n,
        "mean_batch": round(rows / max(n, 1), 1),
        "capacity": int(eng.cache.capacity),
        "slots": int(eng.cache.slots),
        "ms_per_step": round(1e3 * wall / max(n, 1), 3),
        "forward_ms_per_step": round(1e3 * fwd / max(n, 1), 3),
        "host_ms_per_step": round(1e3 * (wall - fwd) / max(n, 1), 3),
        "graphs": {
            k: ver.graph_stats[k] - before.get(k, 0) for k in ("replays", "eager", "captures")
        },
    }


def markdown(rep: dict) -> list[str]:
    one = [r for r in rep["grid"] if r.get("tree", 1) == 1]
    whole = [r for r in one if not r["buckets"]]
    caps = sorted({r["capacity"] for r in whole})
    bats = sorted({r["batch"] for r in whole})
    cell = {(r["batch"], r["capacity"]): r for r in whole}
    mode = next((r["mode"] for r in rep["grid"]), "-")
    lines = [
        f"one-token verify of {rep['target']} ({rep['dtype']}) on {rep['device']}: B rows of "
        f"{rep['context']} cached tokens in a cache of C columns, ms ({mode}, fastest of the "
        "repeats, synchronised)",
        "",
        "| B \\ C | " + " | ".join(str(c) for c in caps) + " |",
        "|---:|" + "---:|" * len(caps),
    ]
    for b in bats:
        vals = [f"{cell[(b, c)]['ms']:.3f}" if (b, c) in cell else "-" for c in caps]
        lines.append(f"| {b} | " + " | ".join(vals) + " |")
    bucketed = {r["capacity"]: r for r in one if r["buckets"]}
    if bucketed:
        b = next(iter(bucketed.values()))["batch"]
        vals = [
            f"{bucketed[c]['ms']:.3f} (span {bucketed[c]['span']})" if c in bucketed else "-"
            for c in caps
        ]
        lines.append(f"| {b}, span_buckets | " + " | ".join(vals) + " |")
    trees = [r for r in rep["grid"] if r.get("tree", 1) > 1]
    if trees:
        cell = {(r["attention"], r["capacity"]): r["ms"] for r in trees}
        lines += [
            "",
            f"{trees[0]['tree']}-token chain per row, {trees[0]['batch']} rows, ms by attention "
            "(packed: redraft's; sdpa: transformers' copy of the keys and values per query head)",
            "",
            "| attention \\ C | " + " | ".join(str(c) for c in caps) + " |",
            "|---|" + "---:|" * len(caps),
        ]
        for impl in ("packed", "sdpa"):
            vals = [f"{cell[(impl, c)]:.3f}" if (impl, c) in cell else "-" for c in caps]
            lines.append(f"| {impl} | " + " | ".join(vals) + " |")
    if rep.get("eager_ms"):
        e = rep["eager_ms"]
        lines += ["", f"eager forward at B={e['batch']}, C={e['capacity']}: {e['ms']:.3f} ms"]
    if rep.get("engine"):
        lines += [
            "",
            "engine (EngineReplies, greedy, no stop id), per steady step:",
            "",
            "| span_buckets | speculate | mean batch | capacity | slots | steps | ms per step | "
            "forward ms | host ms | replays / eager / captures |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for e in rep["engine"]:
            lines.append(
                f"| {'on' if e['span_buckets'] else 'off'} | "
                f"{'on' if e.get('speculate') else 'off'} | {e['mean_batch']} | "
                f"{e['capacity']} | {e['slots']} | {e['steps']} | {e['ms_per_step']:.3f} | "
                f"{e['forward_ms_per_step']:.3f} | {e['host_ms_per_step']:.3f} | "
                f"{e['graphs']['replays']} / {e['graphs']['eager']} / {e['graphs']['captures']} |"
            )
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="engine_profile.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--target", default="default", help="target spec")
    p.add_argument("--device", default=None, help="torch device (cuda when available)")
    p.add_argument("--dtype", default="bfloat16", help="target dtype")
    p.add_argument("--context", type=int, default=400, help="tokens each grid row holds")
    p.add_argument("--batches", default="1,8,64", help="grid batch sizes, comma list")
    p.add_argument("--capacities", default="1024,4096,8192", help="grid cache columns, comma list")
    p.add_argument(
        "--tree",
        type=int,
        default=16,
        help="grid: tokens per row of the tree points (largest batch, packed vs sdpa; 0: none)",
    )
    p.add_argument("--repeats", type=int, default=5, help="forwards timed per point (fastest kept)")
    p.add_argument("--batch", type=int, default=64, help="engine part: rows in flight")
    p.add_argument("--prompt-tokens", type=int, default=200, help="engine part: prompt length")
    p.add_argument("--max-new-tokens", type=int, default=512, help="engine part: reply length")
    p.add_argument(
        "--steps", type=int, default=40, help="engine part: steady steps timed (0: skip)"
    )
    p.add_argument(
        "--grow-to",
        type=int,
        default=4000,
        help="engine part: a prompt of this many tokens (one new token) passes through first, "
        "so the cache has the columns a distillation's longest prompt gives it (0: none)",
    )
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--markdown", default=None, help="Markdown tables to write")
    args = p.parse_args(argv)

    import torch

    from redraft.errors import RedraftError
    from redraft.models import load_target
    from redraft.utils import atomic_write_text, resolve_device

    try:
        device = resolve_device(args.device)
        batches = [int(s) for s in args.batches.split(",")]
        capacities = [int(s) for s in args.capacities.split(",")]
    except (RedraftError, ValueError) as exc:
        print(f"engine_profile.py: error: {exc}", file=sys.stderr)
        return 2
    target = load_target(args.target, dtype=args.dtype, device=device)
    rep = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "target": args.target,
        "dtype": args.dtype,
        "context": args.context,
        "grid": [],
        "eager_ms": {},
        "engine": [],
    }

    def write():  # after each part: a stopped run keeps what it measured
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(rep, indent=1))
        if args.markdown:
            atomic_write_text(args.markdown, "\n".join(markdown(rep)) + "\n")

    rep["grid"], rep["eager_ms"] = grid(
        target, batches, capacities, args.context, args.repeats, args.tree
    )
    write()
    # (True, True) is what redraft-distill-data runs on CUDA: its 21-22 ms step at ~60 rows
    # against the plain engine's 8.3 with span buckets
    runs = ((False, False), (True, False), (False, True), (True, True))
    for buckets, speculate in runs if args.steps else ():
        rep["engine"].append(
            engine_run(
                target,
                args.batch,
                args.prompt_tokens,
                args.max_new_tokens,
                args.steps,
                buckets,
                args.grow_to,
                speculate,
            )
        )
        print(f"engine: {rep['engine'][-1]}", flush=True)
        write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
