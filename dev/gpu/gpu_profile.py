"""Where a verify forward's time goes on one device: eager and graph-replayed forwards of a few
tree sizes, the kernels each launches and the slowest ones.

    python dev/gpu/gpu_profile.py --target default --device cuda --dtype bfloat16 \
        --out profile.json --markdown profile.md

Stage quick of ``dev/gpu/gpu-run.sh``. Why it exists: a GPU run
measured the default target's verify at 3.8 ms for one token and 7.5 ms for 2-65
(the same 2x from 2 tokens on), and a speculative step's time outside the timed forward at
3-6 ms against 0.5 ms for plain decoding; which kernels make the difference needs a profile on
the GPU itself. For each tree size (a chain of that many tokens over a ``--context``-token
cache, the decoder's own static verify and LM head): the fastest of ``--repeats`` eager
forwards and of as many CUDA-graph replays (synchronised), the kernels one eager forward
launches (on a CPU: the ``aten`` ops, nested ones included), the attention kernels among them
(which SDPA backend ran) and the slowest kernels of the largest size.
Output JSON: ``{"device", "torch", "target", "dtype", "context", "sizes": {n: {"eager_ms",
"replay_ms", "kernels", "attention"}}, "top": [[name, calls, ms], ...]}``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ATTENTION_WORDS = ("fmha", "flash", "attention", "efficient", "softmax", "sdpa")


def _best_ms(fn, sync, repeats: int) -> float:
    """The fastest of ``repeats`` synchronised calls, in ms (the decoder's own timing)."""
    from redraft.infer.runner.cost import measure_cost_curve

    return round(1e3 * float(measure_cost_curve(lambda _: fn(), [1], repeats, sync).raw[0]), 3)


def _kernels(fn, cuda: bool):
    """The kernels (CUDA) or aten ops (CPU) one call of ``fn`` runs: [(name, device ms)]."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, getattr(e, "device_time_total", 0.0) / 1e3))
        elif not cuda and e.name.startswith("aten::"):
            out.append((e.name, e.cpu_time_total / 1e3))
    return out


def norm_kernels(target, device, n: int, repeats: int) -> dict:
    """The target's first RMSNorm (transformers' module: upcast, square, mean, rsqrt, scale,
    downcast, weight: ~7 kernels, twice per layer), redraft's fused forward (the one the loaded
    target runs, ``redraft.models.fused``) and ``torch.nn.functional.rms_norm``
    (one fused kernel where the build has one) on ``n`` tokens: kernels (CUDA) or aten ops
    (CPU), ms, and the largest difference. Whether swapping it would cut a forward's kernels
    (1356 per eager forward of the default target on a GPU) without changing its output."""
    import torch

    layer = getattr(target.model, target.model.base_model_prefix).layers[0]
    norm = layer.input_layernorm
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    x = torch.randn(1, n, norm.weight.shape[0], dtype=norm.weight.dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {}
    from redraft.models.fused import fused_rms_norm_forward

    fns = {
        "module": lambda: type(norm).forward(norm, x),  # transformers' own forward
        "redraft": lambda: fused_rms_norm_forward(norm, x),  # what load_target gives the model
        "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, norm.weight.shape, norm.weight, eps),
    }
    with torch.inference_mode():
        for name, fn in fns.items():
            out[name] = {
                "kernels": len(_kernels(fn, device.type == "cuda")),
                "ms": _best_ms(fn, sync, repeats),
            }
        ref = fns["module"]()
        diff = (ref.float() - fns["F.rms_norm"]().float()).abs().max()
        mine = fns["redraft"]()
        out["redraft_max_abs_diff"] = float((ref.float() - mine.float()).abs().max())
        out["redraft_differing"] = float((ref != mine).float().mean())
    out["max_abs_diff"] = float(diff)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="gpu_profile.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--target", default="default", help="target spec")
    p.add_argument("--device", default=None, help="torch device (cuda when available)")
    p.add_argument("--dtype", default="bfloat16", help="target dtype")
    p.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    p.add_argument("--sizes", default="1,2,16,32", help="tree sizes (root included), comma list")
    p.add_argument("--repeats", type=int, default=5, help="forwards timed per size (fastest kept)")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--markdown", default=None, help="Markdown table to write")
    args = p.parse_args(argv)

    import torch

    from redraft.errors import RedraftError
    from redraft.infer.runner.verify import Verifier, chain_step
    from redraft.models import load_target
    from redraft.utils import atomic_write_text, resolve_device

    try:
        device = resolve_device(args.device)
        sizes = [int(s) for s in args.sizes.split(",")]
    except (RedraftError, ValueError) as exc:
        print(f"gpu_profile.py: error: {exc}", file=sys.stderr)
        return 2
    cuda = device.type == "cuda"
    target = load_target(args.target, dtype=args.dtype, device=device)
    ver = Verifier(target, static=True)
    cache = ver.new_cache(1, args.context + max(sizes) + 1)
    ver.prefill([[0] * args.context], cache)
    cache.batch, cache.host_lengths = 1, [args.context]
    report = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "target": args.target,
        "dtype": args.dtype,
        "context": args.context,
        "sizes": {},
        "top": [],
    }
    with torch.inference_mode():
        for n in sizes:
            step = chain_step([args.context], n, device)

            def eager(step=step):
                ver.logits(ver._tree_forward(step, cache, static=True))

            def graph(step=step):
                ver.logits(ver.verify(step, cache))

            row = {"eager_ms": _best_ms(eager, ver.sync, args.repeats), "replay_ms": None}
            if cuda:
                ver._last_key = None
                for _ in range(2):  # the second call in a row captures
                    graph()
                if any(k[:2] == (1, n) for k in cache.graph_set.entries):
                    row["replay_ms"] = _best_ms(graph, ver.sync, args.repeats)
            ks = _kernels(eager, cuda)
            row["kernels"] = len(ks)
            row["attention"] = sorted(
                {k for k, _ in ks if any(w in k.lower() for w in ATTENTION_WORDS)}
            )[:6]
            report["sizes"][n] = row
            if n == max(sizes):
                agg = collections.defaultdict(lambda: [0, 0.0])
                for k, ms in ks:
                    agg[k][0] += 1
                    agg[k][1] += ms
                report["top"] = [
                    [k[:120], c, round(ms, 3)]
                    for k, (c, ms) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:10]
                ]
            print(f"{n} tokens: {row}", flush=True)
        report["norm"] = norm_kernels(target, device, max(sizes), args.repeats)
        print(f"norm: {report['norm']}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(report, indent=1))
    if args.markdown:
        atomic_write_text(args.markdown, "\n".join(markdown(report)) + "\n")
    return 0


def markdown(rep: dict) -> list[str]:
    unit = "kernels" if rep["device"] != "cpu" else "aten ops (nested)"
    lines = [
        f"verify forward of {rep['target']} ({rep['dtype']}) on {rep['device']}, one row over a "
        f"{rep['context']}-token cache, LM head included; fastest of the repeats, synchronised",
        "",
        f"| tokens | eager ms | graph replay ms | {unit} per eager forward | attention |",
        "|---:|---:|---:|---:|---|",
    ]
    for n, r in rep["sizes"].items():
        replay = "-" if r["replay_ms"] is None else f"{r['replay_ms']:.3f}"
        lines.append(
            f"| {n} | {r['eager_ms']:.3f} | {replay} | {r['kernels']} | "
            f"{', '.join(a[:60] for a in r['attention']) or '-'} |"
        )
    if rep.get("norm"):
        nm = rep["norm"]
        lines += [
            "",
            f"RMSNorm of the largest size: transformers' module {nm['module']['kernels']} "
            f"{unit}, {nm['module']['ms']:.3f} ms; `F.rms_norm` {nm['F.rms_norm']['kernels']}, "
            f"{nm['F.rms_norm']['ms']:.3f} ms; largest difference {nm['max_abs_diff']:.3g}",
        ]
        if "redraft" in nm:
            lines[-1] += (
                f"; redraft's (`weight * F.rms_norm(x)`, what load_target gives the model) "
                f"{nm['redraft']['kernels']}, {nm['redraft']['ms']:.3f} ms, largest difference "
                f"{nm['redraft_max_abs_diff']:.3g}, {100 * nm['redraft_differing']:.3f}% of the "
                f"elements differ"
            )
    if rep["top"]:
        lines += ["", f"slowest {unit} of the largest size (calls, ms):", ""]
        lines += [f"- `{k}`: {c}, {ms:.3f}" for k, c, ms in rep["top"]]
    return lines


if __name__ == "__main__":
    sys.exit(main())
