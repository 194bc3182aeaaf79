"""The speedup that a target's verify-cost curve predicts for a measured tau (stage c).

    python dev/gpu/gpu_predict.py --cost cost.json [--overhead overhead.json] \
        [--bench bench-bfloat16.json ...] --out predict.json --markdown predict.md

A speculative step emits tau tokens on average (the bench's ``tokens_per_call``) and costs one
verify forward of the K+1 tree tokens plus the decoder's host work; a plain step emits one
token for a forward of one token plus its host work, so::

    predicted speedup = tau * (c(1) + h_plain) / (c(K + 1) + h_method)

``c``: the target's curve from ``dev/gpu/gpu_cost.py`` (interpolated by the decoder's own
``CostCurve``). ``h``: host milliseconds per step at batch 1 from ``redraft-bench --overhead``,
which decodes with a tiny random target so that only the decoder's own work is left: the same
for every target (0 without an overhead file; the table says so). A bench method takes the
overhead row of the same name, else the row that does its work (:data:`OVERHEAD_ROW`). K is
the bench's ``tree_nodes_per_step`` (tree nodes verified per step) where it reports one, else
each of ``--nodes``. The tau
comes from another target (the default 135M one): the result is a what-if for the larger
target's verify cost, not a measurement on it. Without a bench file, tau runs over 1.5..3.

It also gives the host share of a verify step, ``h / c(K + 1)`` for every overhead row (the
issue's aim: under 10% on dummy:llama-8b), at batch 1 and 8.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_TAUS = (1.5, 2.0, 2.5, 3.0)
# bench method -> the overhead row that measures the same decoder work
OVERHEAD_ROW = {
    "context": "context-16",
    "mix": "ngrammys",
    "aded": "mix-aded",
    "mix+aded": "mix-aded",
}
# tree size each overhead row verifies (auto-budget rows: the size the share is quoted at)
ROW_NODES = {"greedy": 0, "context-16": 16, "context-64": 64}


def taus_from_bench(paths) -> list[dict]:
    """Rows ``{"source", "dataset", "method", "tau", "nodes"}`` of every speculative method."""
    rows = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        dtype = (data.get("config") or {}).get("dtype", "?")
        for ds, res in (data.get("results") or {}).items():
            for method, r in res.items():
                tau = r.get("tokens_per_call")
                if tau is None or method in ("greedy", "hf-greedy"):
                    continue
                rows.append(
                    {
                        "source": f"{Path(p).stem} ({dtype})",
                        "dataset": ds,
                        "method": method,
                        "tau": float(tau),
                        "nodes": r.get("tree_nodes_per_step"),
                    }
                )
    return rows


def host_ms(overhead: dict, method: str, batch: str = "batch_1") -> float | None:
    rows = overhead.get("overhead", {})
    row = rows.get(method) or rows.get(OVERHEAD_ROW.get(method, ""))
    return None if not row or batch not in row else float(row[batch]["host_ms_per_step"])


def predict(cost: dict, overhead: dict, rows: list[dict], nodes: list[int]) -> dict:
    """``{target: {"curve_ms", "host_ms_plain", "rows": [{..., "speedup": {K: x}}], "host_share"}}``."""
    import torch

    from redraft.infer.runner.cost import CostCurve

    out = {}
    for spec, t in cost["targets"].items():
        c = t["cost_curve_ms"]
        curve = CostCurve(c["sizes"], c["ms"])

        def ms(n):
            return float(curve(torch.tensor([float(n)]))[0])

        h_plain = host_ms(overhead, "greedy") or 0.0
        pred_rows = []
        for r in rows:
            h = host_ms(overhead, r["method"]) or 0.0
            ks = [int(round(r["nodes"]))] if r.get("nodes") else nodes
            pred_rows.append(
                {
                    **r,
                    "host_ms": h,
                    "speedup": {
                        k: round(r["tau"] * (ms(1) + h_plain) / (ms(k + 1) + h), 3) for k in ks
                    },
                }
            )
        share = {}
        for m, v in overhead.get("overhead", {}).items():
            k = ROW_NODES.get(m, 16)
            share[m] = {
                "nodes": k,
                **{
                    b: round(v[b]["host_ms_per_step"] / ms(k + 1), 4)
                    for b in ("batch_1", "batch_8")
                    if b in v
                },
            }
        out[spec] = {
            "curve_ms": {n: round(ms(n), 3) for n in (1, 9, 17, 33, 65)},
            "host_ms_plain": h_plain,
            "has_overhead": bool(overhead),
            "host_share": share,
            "rows": pred_rows,
        }
    return out


def markdown(pred: dict, nodes: list[int], measured: bool) -> str:
    lines = [
        "## predicted speedup from the verify-cost curves",
        "",
        "speedup = tau x (c(1) + host_plain) / (c(K+1) + host_method); tau "
        + (
            "measured on the default target (a what-if for the larger target)"
            if measured
            else "NOT measured yet (no bench file): a grid"
        ),
        "",
    ]
    for spec, p in pred.items():
        curve = ", ".join(f"c({n})={v:.2f}" for n, v in p["curve_ms"].items())
        lines += [
            f"### {spec}",
            "",
            f"verify ms: {curve}; host ms per plain step {p['host_ms_plain']:.2f}"
            + ("" if p["has_overhead"] else " (no overhead measurement: verify cost only)"),
            "",
            "| tau from | dataset | method | tau | " + " | ".join(f"K={k}" for k in nodes) + " |",
            "|---|---|---|---:|" + "---:|" * len(nodes),
        ]
        for r in p["rows"]:
            if r.get("nodes"):
                cells = [f"{v:.2f}x (K={k})" for k, v in r["speedup"].items()] + [""] * (
                    len(nodes) - 1
                )
            else:
                cells = [f"{r['speedup'][k]:.2f}x" for k in nodes]
            lines.append(
                f"| {r['source']} | {r['dataset']} | {r['method']} | {r['tau']:.2f} | "
                + " | ".join(cells)
                + " |"
            )
        if p["host_share"]:
            lines += [
                "",
                "host work per step / verify of K+1 tokens (aim: < 10% on dummy:llama-8b):",
                "",
                "| overhead row | K | batch 1 | batch 8 |",
                "|---|---:|---:|---:|",
            ]
            for m, s in p["host_share"].items():
                cells = [f"{100 * s[b]:.1f}%" if b in s else "-" for b in ("batch_1", "batch_8")]
                lines.append(f"| {m} | {s['nodes']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="gpu_predict.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--cost", required=True, help="dev/gpu/gpu_cost.py output")
    p.add_argument("--overhead", help="redraft-bench --overhead output")
    p.add_argument(
        "--bench",
        action="append",
        default=[],
        help="redraft-bench output with measured tau (repeatable)",
    )
    p.add_argument(
        "--nodes",
        default="8,16,32,64",
        help="tree sizes K to predict for (when the bench has none)",
    )
    p.add_argument("--out", required=True, help="JSON to write")
    p.add_argument("--markdown", help="Markdown table to write (also printed)")
    args = p.parse_args(argv)
    try:
        cost = json.loads(Path(args.cost).read_text())
        overhead = json.loads(Path(args.overhead).read_text()) if args.overhead else {}
        rows = taus_from_bench(args.bench)
        nodes = [int(x) for x in args.nodes.split(",")]
    except (OSError, ValueError, KeyError) as exc:
        print(f"gpu_predict.py: error: {exc}", file=sys.stderr)
        return 2
    measured = bool(rows)
    if not rows:
        rows = [
            {"source": "grid", "dataset": "-", "method": "-", "tau": t, "nodes": None}
            for t in DEFAULT_TAUS
        ]
    pred = predict(cost, overhead, rows, nodes)
    md = markdown(pred, nodes, measured)
    print(md)
    Path(args.out).write_text(json.dumps({"measured_tau": measured, "targets": pred}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
