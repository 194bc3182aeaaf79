"""Verify-cost curves of targets on one device: the decoder's own measurement
(``SpeculativeDecoder.measure_cost``: one row, a cache of ``--context`` tokens, forwards of
1..65 tokens, fastest of 3, synchronised on CUDA), plus how long the target took to load.

    python dev/gpu/gpu_cost.py --target dummy:llama-1b --target dummy:llama-8b --device cuda \
        --dtype bfloat16 --context 512 --out cost.json

Stage c of ``dev/gpu/gpu-run.sh``; ``dev/gpu/gpu_predict.py`` turns the curves into predicted
speedups. Output JSON: ``{"device", "torch", "context", "targets": {spec: {"load_s", "params",
"dtype", "cost_curve_ms": {"sizes": [...], "ms": [...]}, "peak_mem_mib"}}}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each default shown once: options whose help states its own default (None here) add none."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="gpu_cost.py", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument(
        "--target",
        action="append",
        required=True,
        help="target spec (repeatable), e.g. dummy:llama-8b",
    )
    p.add_argument(
        "--device", default=None, help="torch device (default: cuda when available, else cpu)"
    )
    p.add_argument("--dtype", default="bfloat16", help="target dtype")
    p.add_argument(
        "--context", type=int, default=512, help="tokens already in the cache when verifying"
    )
    p.add_argument(
        "--max-nodes", type=int, default=64, help="largest tree measured (plus its root)"
    )
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)

    import torch

    from redraft.errors import RedraftError
    from redraft.infer import SpeculativeDecoder
    from redraft.models import load_target
    from redraft.utils import atomic_write_text, resolve_device

    try:
        device = resolve_device(args.device)
    except RedraftError as exc:
        print(f"gpu_cost.py: error: {exc}", file=sys.stderr)
        return 2
    cuda = device.type == "cuda"
    report = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "context": args.context,
        "dtype": args.dtype,
        "targets": {},
    }
    for spec in args.target:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        target = load_target(spec, dtype=args.dtype, device=device)
        if cuda:
            torch.cuda.synchronize(device)
        load_s = time.perf_counter() - t0
        dec = SpeculativeDecoder(target, [], max_nodes=args.max_nodes)
        curve = dec.measure_cost(context=args.context)
        report["targets"][spec] = {
            "load_s": round(load_s, 2),
            "params": sum(p.numel() for p in target.model.parameters()),
            "cost_curve_ms": curve.to_dict(),
            "peak_mem_mib": round(torch.cuda.max_memory_allocated(device) / 2**20)
            if cuda
            else None,
        }
        c = report["targets"][spec]["cost_curve_ms"]
        print(
            f"{spec}: loaded in {load_s:.1f} s; verify ms by tokens: "
            + ", ".join(f"{n}:{ms}" for n, ms in zip(c["sizes"], c["ms"])),
            flush=True,
        )
        del dec, target
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
