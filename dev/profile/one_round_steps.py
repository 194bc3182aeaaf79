"""The load test's one-round levels replayed through the engine alone, with where the time went.

    python dev/profile/one_round_steps.py on|off [--reps 1] [--levels 1,2,4,8,16] [--max-tokens 64]
        [-- SERVE FLAGS...]    e.g. -- --ngrams checkpoints/ngrams-smollm2

The decoder is the one ``redraft-serve --target default --dtype float32 FLAGS`` builds ("off":
with ``--no-speculation``), loaded and warmed up as the server does (batched verify costs, then
a short generation), on the thread that decodes. Each level adds the load test's first C
held-out chat prompts at once (greedy, ``--max-tokens`` each) and steps until all are done; the
levels run in one engine one after the other, as a server keeps its state across a load test.

Prints one JSON line per level: output tokens/s, the last first token (``ttft_max``: the
admission) and what came after it (``tail``), the forwards by kind (P: prefill of its own, V:
verify, F: verify carrying a prefill piece) with their milliseconds, and ``per``: for every
step kind (A: prompts being admitted, D: none) and batch size, ``[tokens, seconds, steps,
tokens/s]``, and the pacing of the long prompts' pieces: ``F`` (each verify that carried a
piece: piece tokens, verify tokens, ms), ``V`` (each plain verify: tokens, ms) and
``fused_fit`` (the pacer's fit of a riding piece's own cost at the level's end: ms a token, us a
token and attended column; null where it does not hold). Run "on" and "off" alternately (one
process each) and compare: the engine alone has no HTTP, no client and a fixed arrival (all at
once), so a difference here is the decoder's.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import torch

from redraft.bench.loadtest import build_parser as loadtest_parser
from redraft.data.prompts import load_prompts
from redraft.infer.config import SamplingParams
from redraft.serve import cli
from redraft.serve.scheduler import Scheduler


def fit_ms(ab):
    """The pacer's ``(a, b)`` in ms a token and us a token and column (None stays None)."""
    return None if ab is None else [round(ab[0] * 1e3, 3), round(ab[1] * 1e6, 3)]


def main() -> None:
    argv = sys.argv[1:]
    serve_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("on", "off"))
    p.add_argument("--reps", type=int, default=1, help="passes over the levels")
    p.add_argument("--levels", default="1,2,4,8,16", help="concurrency levels, in order")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    args = p.parse_args(argv)
    flags = ["--target", "default", "--dtype", "float32", *serve_flags]
    parser = cli.build_parser()
    sargs = parser.parse_args(flags + ([] if args.mode == "on" else ["--no-speculation"]))
    cli.check_args(sargs, parser)
    dec = cli.load(sargs)
    lt = loadtest_parser().parse_args(["--spawn", "x"])
    levels = [int(x) for x in args.levels.split(",")]
    held = load_prompts(lt.dataset, lt.prompts)  # the load test's prompts, stream i gets i
    prompts = [dec.encode(held[j % len(held)])[0] for j in range(max(levels))]
    eng = dec.engine()
    warm = Scheduler(dec, max_batch=16, make_params=SamplingParams.checked)
    warm._warm(eng)

    forwards = []  # (kind, tokens, ms, verify tokens) of this level's forwards
    verifier = eng.verifier

    def verify_tokens(state, *a):
        return state.packed.shape[0] * state.size

    def timed(kind, fn, tokens):
        def run(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            ms = (time.perf_counter() - t) * 1e3
            forwards.append((kind, tokens(*a), ms, verify_tokens(*a) if kind != "P" else 0))
            return out

        return run

    verifier.verify = timed("V", verifier.verify, verify_tokens)
    verifier.verify_with_piece = timed(
        "F", verifier.verify_with_piece, lambda s, c, toks, *a: len(toks) * len(toks[0])
    )
    verifier.prefill = timed("P", verifier.prefill, lambda toks, *a: len(toks) * len(toks[0]))
    params = SamplingParams.checked(max_new_tokens=args.max_tokens, temperature=0)
    for rep in range(args.reps):
        for C in levels:
            forwards.clear()
            per = collections.defaultdict(lambda: [0, 0.0, 0])
            first: dict[int, float] = {}
            t0 = time.perf_counter()
            for j in range(C):
                eng.add(prompts[j], params)
            while eng.has_work:
                admitting = bool(eng.waiting or eng.prefilling)
                s0 = time.perf_counter()
                events = eng.step()
                dt = time.perf_counter() - s0
                # rows verified in the step (finished rows leave at the next one)
                key = ("A" if admitting else "D") + str(len(eng.rows))
                per[key][0] += sum(len(e.tokens) for e in events)
                per[key][1] += dt
                per[key][2] += 1
                for e in events:
                    first.setdefault(e.index, time.perf_counter() - t0)
            wall = time.perf_counter() - t0
            kinds = collections.Counter(f[0] for f in forwards)
            print(
                json.dumps(
                    {
                        "mode": args.mode,
                        "rep": rep,
                        "streams": C,
                        "tok_s": round(sum(v[0] for v in per.values()) / wall, 1),
                        "ttft_max": round(max(first.values()), 2),
                        "tail": round(wall - max(first.values()), 2),
                        "forwards": dict(kinds),
                        "ms": {k: round(sum(f[2] for f in forwards if f[0] == k)) for k in kinds},
                        "per": {
                            k: [v[0], round(v[1], 2), v[2], round(v[0] / v[1], 1)]
                            for k, v in sorted(per.items())
                        },
                        # [piece tokens, verify tokens, ms] of each verify that carried a piece
                        "F": [[f[1], f[3], round(f[2], 1)] for f in forwards if f[0] == "F"],
                        # [verify tokens, ms] of the plain verifies
                        "V": [[f[3], round(f[2], 1)] for f in forwards if f[0] == "V"],
                        # the pacer's fit of a riding piece's own cost (ms a token, us a token
                        # and column)
                        "fused_fit": fit_ms(eng._pacer.fused_coefficients()),
                        "threads": torch.get_num_threads(),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
