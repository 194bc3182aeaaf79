"""Verify-forward cost of a target on this CPU, float32, logits included, by rows x tokens a
row, with the packed products' row padding as measured at load or off (the kernels planned
without it, as before padding existed); the fastest of ``--rounds`` (docs/infer.md, "CPU
kernels"). Run it once per setting, alternating, in fresh processes:

    python dev/profile/row_padding.py --padding measured
    python dev/profile/row_padding.py --padding off
"""

import argparse
import time

import torch

from redraft.infer.runner.verify import Verifier, chain_step
from redraft.models import cpu, load_target

SHAPES = ((1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (1, 4), (4, 1), (1, 8), (8, 1), (16, 1))
CONTEXT = 256


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--padding", choices=("measured", "off"), default="measured")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--target", default="default")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.padding == "off":
        cpu._ROW_PAD[args.threads] = {}  # as if padding paid nowhere: planned without it
    v = Verifier(load_target(args.target, dtype="float32"))
    print(f"kernels: {v.kernels or 'the default ones'}")
    runs = {}
    for B, n in SHAPES:
        cache = v.new_cache(B, CONTEXT + n + 1)
        v.prefill([[0] * CONTEXT] * B, cache)
        cache.batch, cache.host_lengths = B, [CONTEXT] * B
        runs[B, n] = (chain_step([CONTEXT] * B, n, v.device), cache)
    best: dict = {}
    for _ in range(args.rounds):
        for shape, (step, cache) in runs.items():
            v.logits(v.verify(step, cache))  # warm
            t0 = time.perf_counter()
            v.logits(v.verify(step, cache))
            best[shape] = min(best.get(shape, 1e9), time.perf_counter() - t0)
    print("rows x tokens: " + " ".join(f"{b}x{n:<3}" for b, n in SHAPES))
    print(f"{args.padding:>13}: " + " ".join(f"{1e3 * best[s]:5.1f}" for s in SHAPES) + "  ms")


if __name__ == "__main__":
    main()
