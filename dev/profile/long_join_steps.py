"""The load test's long-join scenario replayed through the engine alone, step by step.

    python dev/profile/long_join_steps.py [--streams 8] [--long-tokens 4000] [--join-after 15]
        [--threads 2] [--max-tokens 64] [--fuse-prefill auto|true|false]

Eight streams (held-out chat prompts, greedy, ``--max-tokens`` each) decode back to back; a
stream's next request is added *after* the step that finished its previous one, as an HTTP
client's would arrive. After ``--join-after`` seconds a ``--long-tokens`` prompt joins; the run
ends when it has its 8 tokens. Prints the streams' inter-token gaps (p50 before the join, p50 /
p99 while the long request runs, p99 over the median before: the issue-24 aim is <= 3) and the
slowest steps with where their time went (prefill forwards, cache row copies, cache growth,
verify), so a bad p99 can be traced to its cause without HTTP in the way.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from redraft.bench.loadtest import long_prompt_text
from redraft.bench.overhead import Timers
from redraft.data.prompts import load_prompts
from redraft.infer.loader import load_decoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams")
    ap.add_argument("--long-tokens", type=int, default=4000, help="tokens of the long prompt")
    ap.add_argument("--join-after", type=float, default=15.0, help="seconds before it joins")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per stream request")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--prefill-chunk", default="auto", help="the decoder's prefill_chunk")
    ap.add_argument(
        "--fuse-prefill", default="auto", help="the decoder's fuse_prefill (auto, true, false)"
    )
    ap.add_argument("--dtype", default="float32", help="target dtype")
    ap.add_argument("--top", type=int, default=12, help="slowest steps to print")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    chunk = args.prefill_chunk if args.prefill_chunk == "auto" else int(args.prefill_chunk)
    fuse = {"true": True, "false": False}.get(args.fuse_prefill, args.fuse_prefill)
    dec = load_decoder("default", dtype=args.dtype, prefill_chunk=chunk, fuse_prefill=fuse)
    prompts = load_prompts("chat", 32)
    ids = dec.encode(prompts)
    long_ids = dec.encode([long_prompt_text(prompts, args.long_tokens)])[0][: args.long_tokens]
    run(dec, ids, long_ids, args)


def run(dec, ids: list, long_ids: list, args) -> None:
    eng = dec.engine()
    params = {"max_new_tokens": args.max_tokens}
    timers = Timers()
    timers.wrap(dec.verifier, "prefill", "prefill")
    timers.wrap(dec.verifier, "verify", "verify")
    timers.wrap(dec.verifier, "verify_with_piece", "fused")  # a verify carrying a piece
    owner, k_next = {}, args.streams  # request id -> stream; next prompt index
    for s in range(args.streams):
        owner[eng.add(ids[s % len(ids)], params)] = s
    long_rid, t_join, t_done = None, None, None
    long_filled = 0
    last_tok: dict[int, float] = {}  # request id -> time of its last token event
    gaps = []  # (time, gap seconds)
    steps = []
    t_start = time.perf_counter()
    wrapped_cache = None
    while True:
        if eng.cache is not None and eng.cache is not wrapped_cache:
            timers.wrap(eng.cache, "keep_rows", "copy")
            timers.wrap(eng.cache, "reserve", "grow")
            wrapped_cache = eng.cache
        t0 = time.perf_counter()
        pre = [f"{r.filled}/{len(r.prompt)}" for r in eng.prefilling] + [
            f"w{len(r.prompt)}" for r in eng.waiting
        ]
        events = eng.step()
        t1 = time.perf_counter()
        parts = timers.take()
        long_row = [r for r in eng.prefilling if r.rid == long_rid]
        if long_row and long_row[0].filled != long_filled:
            parts["tokens"] = (long_row[0].filled - long_filled) / 1e3  # printed x 1e3 below
            parts["long_piece"] = 1
            long_filled = long_row[0].filled
        steps.append((t1 - t0, t0 - t_start, eng.batch_size, pre, parts))
        for ev in events:
            if ev.index == long_rid:
                if ev.done:
                    t_done = t1
                continue
            if ev.tokens and ev.index in last_tok:
                gaps.append((t1, t1 - last_tok[ev.index]))
            last_tok[ev.index] = t1
            if ev.done:
                s = owner.pop(ev.index)
                owner[eng.add(ids[k_next % len(ids)], params)] = s  # arrives after the step
                k_next += 1
        if gaps and long_rid is None and t1 - gaps[0][0] >= args.join_after:
            long_rid, t_join = eng.add(long_ids, {"max_new_tokens": 8}), t1
        if t_done is not None:
            break
    before = [g for t, g in gaps if t < t_join]
    during = [g for t, g in gaps if t_join <= t <= t_done]
    p50b = 1e3 * np.median(before)
    p50d, p99d = (1e3 * np.percentile(during, q) for q in (50, 99))
    print(
        f"long TTFT {t_done - t_join:.1f} s (to its 8th token); gaps before {len(before)}, "
        f"p50 {p50b:.0f} ms; during {len(during)}, p50 {p50d:.0f} / p99 {p99d:.0f} ms; "
        f"p99 / p50 before = {p99d / p50b:.2f}"
    )
    during_steps = [s for s in steps if t_join - t_start <= s[1] <= t_done - t_start]
    pieces = [s[4]["tokens"] * 1e3 for s in during_steps if s[4].get("long_piece")]
    if pieces:
        print(
            f"the long prompt: {len(pieces)} pieces in {len(during_steps)} steps, tokens per "
            f"piece p10 / p50 / p90 {np.percentile(pieces, 10):.0f} / {np.median(pieces):.0f} / "
            f"{np.percentile(pieces, 90):.0f}"
        )
    for name, sel in (
        ("with a prefill", [s for s in during_steps if {"prefill", "fused"} & set(s[4])]),
        ("without", [s for s in during_steps if not {"prefill", "fused"} & set(s[4])]),
    ):
        if sel:
            tot = 1e3 * np.array([s[0] for s in sel])
            pre = 1e3 * np.array([s[4].get("prefill", 0.0) for s in sel])
            ver = 1e3 * np.array([s[4].get("verify", s[4].get("fused", 0.0)) for s in sel])
            print(
                f"  {len(sel)} steps {name}: step p50 {np.median(tot):.0f} / p90 "
                f"{np.percentile(tot, 90):.0f} ms, prefill p50 {np.median(pre):.0f} / p90 "
                f"{np.percentile(pre, 90):.0f}, verify p50 {np.median(ver):.0f} / p90 "
                f"{np.percentile(ver, 90):.0f}"
            )
    print(f"slowest {args.top} of {len(during_steps)} steps while it ran (ms):")
    for secs, at, batch, pre, parts in sorted(during_steps, key=lambda s: -s[0])[: args.top]:
        where = " ".join(f"{k} {1e3 * v:.0f}" for k, v in sorted(parts.items()))
        print(f"  {1e3 * secs:6.0f} at {at:6.1f}s batch {batch}: {where}; queue {' '.join(pre)}")


if __name__ == "__main__":
    main()
