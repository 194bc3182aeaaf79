"""Verify-forward cost of a target on this CPU, logits included, for the packed float32 kernels
from the row count the verifier measured against packing fixed from 3 rows (the threshold before
it was measured), both in one process, alternated; the fastest of each (docs/infer.md, "CPU
kernels").

    python dev/profile/verify_curve.py [--threads 2] [--dtype float32] [--target default]

bfloat16 targets have no packed kernels: the script then prints the one curve.
"""

import argparse
import time

import torch

from redraft.infer.runner.verify import Verifier, chain_step
from redraft.models import cpu, load_target

SIZES = (1, 2, 3, 4, 8, 16, 32)
CONTEXT = 256


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--target", default="default")
    p.add_argument("--rounds", type=int, default=5, help="alternations of the two settings")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    v = Verifier(load_target(args.target, dtype=args.dtype))
    print(f"kernels: {v.kernels or 'the default ones'}")
    settings = {"measured": (v.packed_rows, v.head_packed_rows)}
    if v.kernels:
        settings["packed from 3"] = ((cpu.MIN_PACKED_ROWS, cpu.MAX_PACKED_ROWS),) * 2
    cache = v.new_cache(1, CONTEXT + max(SIZES) + 1)
    v.prefill([[0] * CONTEXT], cache)
    cache.batch, cache.host_lengths = 1, [CONTEXT]
    best: dict = {}
    for _ in range(args.rounds):
        for name, (rows, head_rows) in settings.items():
            v.packed_rows, v.head_packed_rows = rows, head_rows
            for n in SIZES:
                step = chain_step([CONTEXT], n, v.device)
                v.logits(v.verify(step, cache))  # warm
                t0 = time.perf_counter()
                v.logits(v.verify(step, cache))
                dt = time.perf_counter() - t0
                best[name, n] = min(best.get((name, n), dt), dt)
    print("tokens: " + " ".join(f"{n:>6}" for n in SIZES))
    for name in settings:
        print(f"{name}: " + " ".join(f"{1e3 * best[name, n]:6.1f}" for n in SIZES) + "  ms")


if __name__ == "__main__":
    main()
