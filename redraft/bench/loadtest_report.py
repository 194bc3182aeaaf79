"""The load test's figures and tables: per level and server (``summarize``, ``markdown``,
``summary_markdown``) and for the long-join scenario (``long_join_markdown``)."""

from __future__ import annotations


def long_join_markdown(table: list[dict]) -> str:
    head = (
        "| server | prompt tokens | long TTFT (s) | ITL p50 before (ms) | ITL p50 / p99 during (ms) "
        "| p99 during / p50 before | gaps during | server step p50 before, p50 / p99 during (ms) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in table:
        lines.append(
            f"| {r['label']} | {r['prompt_tokens']} | {r['long_ttft_ms'] / 1e3:.1f} "
            f"| {r['itl_p50_before_ms']:.0f} "
            f"| {r['itl_p50_during_ms']:.0f} / {r['itl_p99_during_ms']:.0f} | {r['p99_over_median']:.2f} "
            f"| {r['gaps_during']} | {r['step_p50_before_ms']:.0f}, {r['step_p50_during_ms']:.0f} "
            f"/ {r['step_p99_during_ms']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def long_prompt_text(prompts: list, tokens: int) -> str:
    """About ``tokens`` tokens of text (~4 characters a token): the prompts' texts, repeated."""
    texts = [p if isinstance(p, str) else " ".join(m["content"] for m in p) for p in prompts]
    out, i = [], 0
    while sum(map(len, out)) < 4 * tokens:
        out.append(texts[i % len(texts)])
        i += 1
    return "\n\n".join(out)[: 4 * tokens]


# ---------------------------------------------------------------------------------- figures


def summarize(wall: float, results: list) -> dict:
    import numpy as np

    def pct(xs, q):
        return float(np.percentile(xs, q)) if len(xs) else float("nan")

    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    stats = [r["stats"] for r in results if r["stats"]]
    tokens = sum(r["tokens"] for r in results)

    def mean_stat(key):
        xs = [s[key] for s in stats if key in s]
        return float(np.mean(xs)) if xs else None

    return {
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1e3 * pct(ttft, 50),
        "ttft_p99_ms": 1e3 * pct(ttft, 99),
        # of the time to first token, the engine's prefill forwards (the rest: waiting for them)
        "prefill_p50_ms": 1e3
        * pct([s["prefill_time_s"] for s in stats if "prefill_time_s" in s], 50),
        "itl_p50_ms": 1e3 * pct(gaps, 50),
        "itl_p99_ms": 1e3 * pct(gaps, 99),
        "tpot_mean_ms": 1e3 * float(np.mean(tpot)) if tpot else float("nan"),
        "tokens_per_call": mean_stat("tokens_per_call"),
        "mean_accepted_length": mean_stat("mean_accepted_length"),
        "tree_nodes_per_step": mean_stat("tree_nodes_per_step"),
    }


def markdown(table: list[dict]) -> str:
    runs = max(row.get("run", 1) for row in table) > 1
    head = (
        f"| streams |{' run |' if runs else ''} server | output tok/s | x ref | TTFT p50 / p99 (ms) "
        "| prefill p50 (ms) | ITL p50 / p99 (ms) | TPOT (ms) "
        "| tokens/call | accepted len | nodes/row/step | identical |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    for row in table:
        run = f" {row['run']} |" if runs else ""
        lines.append(
            f"| {row['concurrency']} |{run} {row['label']} | {row['tokens_per_s']:.1f} | {row['ratio']:.2f} "
            f"| {row['ttft_p50_ms']:.0f} / {row['ttft_p99_ms']:.0f} | {row['prefill_p50_ms']:.0f} "
            f"| {row['itl_p50_ms']:.0f} / {row['itl_p99_ms']:.0f} "
            f"| {row['tpot_mean_ms']:.1f} | {f(row['tokens_per_call'], '{:.2f}')} "
            f"| {f(row['mean_accepted_length'], '{:.2f}')} | {f(row['tree_nodes_per_step'])} "
            f"| {'yes' if row['identical'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def summary_markdown(table: list[dict]) -> str:
    """Per level and server over the runs: tokens/s and the ratio to the reference (mean and
    range), TTFT p50 and TPOT (means), and whether every run's outputs were identical."""
    import numpy as np

    head = (
        "| streams | server | runs | output tok/s (mean) | x ref: mean [min, max] "
        "| TTFT p50 (ms, mean) | TPOT (ms, mean) | identical |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    keys = list(dict.fromkeys((row["concurrency"], row["label"]) for row in table))
    for c, label in keys:
        rows = [r for r in table if (r["concurrency"], r["label"]) == (c, label)]
        ratio = [r["ratio"] for r in rows]
        lines.append(
            f"| {c} | {label} | {len(rows)} | {np.mean([r['tokens_per_s'] for r in rows]):.1f} "
            f"| {np.mean(ratio):.2f} [{min(ratio):.2f}, {max(ratio):.2f}] "
            f"| {np.mean([r['ttft_p50_ms'] for r in rows]):.0f} "
            f"| {np.mean([r['tpot_mean_ms'] for r in rows]):.1f} "
            f"| {'yes' if all(r['identical'] for r in rows) else 'NO'} |"
        )
    return "\n".join(lines) + "\n"
