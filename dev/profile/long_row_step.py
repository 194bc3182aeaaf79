"""Median engine step of 8 short rows, then with a long row among them (grouped attention).

    python dev/profile/long_row_step.py [--long-tokens 4000] [--threads 2] [--steps 15]

Plain steps (budget 0) of the default target in float32: 8 rows of ~10-token prompts decode;
a ``--long-tokens`` prompt (README text) joins in one piece; prints both medians and the ratio,
first with the grouped attention off (one SDPA call over the longest row), then on, in the same
process (docs/infer.md, "Rows of very different lengths").
"""

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from redraft.infer.loader import load_decoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long-tokens", type=int, default=4000, help="tokens of the long prompt")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per phase")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dec = load_decoder("default", dtype="float32", prefill_chunk=0, budget=0)
    for grouped in (False, True):
        dec.verifier._grouped = grouped
        short, mixed = run(dec, args)
        print(
            f"grouped attention {'on' if grouped else 'off'}: 8 short rows {short:.1f} ms/step; "
            f"with a {args.long_tokens}-token row {mixed:.1f} ms/step ({mixed / short:.2f}x)",
            flush=True,
        )


def run(dec, args) -> tuple[float, float]:
    """(median ms per step of the 8 short rows, then with the long row among them)."""
    tok = dec.target.tokenizer
    eng = dec.engine()
    params = {"max_new_tokens": 1000, "min_tokens": 1000}
    for i in range(8):
        eng.add(tok(f"Tell me a story about the number {i}.")["input_ids"], params)

    def median_step(k: int) -> float:
        ts = []
        for _ in range(k):
            t0 = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts))

    median_step(5)
    short = median_step(args.steps)
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text() * 4
    eng.add(tok(text)["input_ids"][: args.long_tokens], params)
    eng.step()
    return short, median_step(args.steps)


if __name__ == "__main__":
    main()
