"""``redraft-bench --report DIR``: PNG plots and an index.md a person would rather look at.

From one ``redraft-bench`` result (``--out`` JSON, or the run itself):

* ``speedup.png``: tokens/s speedup over plain greedy per method and dataset (bars; the
  baseline is the line at 1.0);
* ``acceptance.png``: tau (new tokens per target call) and mean accepted length per method;
* ``accepted_hist.png``: how many draft tokens each verify step accepted, per method;
* ``cost_curve.png``: the measured verify cost (ms) against tree nodes;
* ``drafter_share.png``: each drafter's share of the accepted tokens in the mix;
* ``overhead.png``: host ms per decode step per method and batch size (``--overhead`` results).

``index.md`` holds the run's settings, the table and the images.
"""

from __future__ import annotations

from pathlib import Path

from redraft.errors import ConfigError


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--report needs matplotlib: pip install matplotlib") from None
    return plt


def _bars(ax, groups: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    """Grouped bars: one group per x label, one bar per series."""
    n = max(len(series), 1)
    width = 0.8 / n
    for i, (name, vals) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, vals, width, label=name)
        for b, v in zip(bars, vals):
            if v:
                ax.annotate(
                    f"{v:.2f}",
                    (b.get_x() + b.get_width() / 2, v),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def write_report(report: dict, directory) -> Path:
    """Write the plots and ``index.md`` into ``directory``; returns the index path."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    figs = _Figures(_plt(), out)
    results = report.get("results", {})
    if results:
        _plot_results(figs, results)
    _plot_cost_curve(figs, report)
    _plot_overhead(figs, report.get("overhead"))
    index = out / "index.md"
    index.write_text("\n".join(_index_lines(report, figs.images)))
    return index


class _Figures:
    """Saves figures into ``out`` and remembers ``(title, file)`` for the index."""

    def __init__(self, plt, out: Path):
        self.plt, self.out, self.images = plt, out, []

    def save(self, fig, name: str, title: str) -> None:
        fig.tight_layout()
        fig.savefig(self.out / name, dpi=120)
        self.plt.close(fig)
        self.images.append((title, name))


def _plot_results(figs: _Figures, results: dict) -> None:
    """Speedup bars, tau and mean accepted length, accepted-length histograms, drafter shares."""
    plt = figs.plt
    datasets = list(results)
    methods = list(dict.fromkeys(m for ds in results.values() for m in ds))
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(methods) + 2), 4))
    _bars(
        ax,
        methods,
        {ds: [results[ds].get(m, {}).get("speedup_vs_ar", 0) for m in methods] for ds in datasets},
        "speedup over plain greedy (tokens/s)",
    )
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_title("Speedup per method (baseline = 1.0, same run)")
    figs.save(fig, "speedup.png", "Speedup over plain greedy")

    spec = [
        m for m in methods if any(results[ds].get(m, {}).get("tokens_per_call") for ds in datasets)
    ]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(spec) + 3), 4))
    for ax, key, label in (
        (axes[0], "tokens_per_call", "tau (new tokens / target call)"),
        (axes[1], "mean_accepted_length", "mean accepted length (vLLM)"),
    ):
        _bars(
            ax,
            spec,
            {ds: [results[ds].get(m, {}).get(key) or 0 for m in spec] for ds in datasets},
            label,
        )
    figs.save(fig, "acceptance.png", "Tokens per target call and mean accepted length")

    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        for m in spec:
            hist = {int(k): v for k, v in results[ds][m].get("accepted_hist", {}).items()}
            total = sum(hist.values()) or 1
            ks = sorted(hist)
            ax.plot(ks, [hist[k] / total for k in ks], marker="o", label=m)
        ax.set_xlabel("draft tokens accepted in a verify step")
        ax.set_ylabel("fraction of steps")
        ax.set_title(ds)
        if spec:
            ax.legend(fontsize=8)
    figs.save(fig, "accepted_hist.png", "Accepted-length histogram")
    _plot_shares(figs, results, datasets, [m for m in methods if m.startswith("mix")])


def _plot_shares(figs: _Figures, results: dict, datasets: list, mixes: list) -> None:
    if not mixes:
        return
    fig, ax = figs.plt.subplots(figsize=(7, 4))
    labels = [f"{ds}\n{m}" for ds in datasets for m in mixes]
    names = sorted(
        {
            d
            for ds in datasets
            for m in mixes
            for d in results[ds].get(m, {}).get("drafter_share", {})
        }
    )
    bottom = [0.0] * len(labels)
    for name in names:
        vals = [
            results[ds].get(m, {}).get("drafter_share", {}).get(name, 0.0)
            for ds in datasets
            for m in mixes
        ]
        ax.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("share of accepted draft tokens")
    ax.set_title("Which drafter's tokens were accepted (a token several proposed counts for each)")
    if names:
        ax.legend(fontsize=8)
    figs.save(fig, "drafter_share.png", "Drafter shares in the mix")


def _plot_cost_curve(figs: _Figures, report: dict) -> None:
    curve = report.get("cost_curve_ms") or {}
    if not curve.get("sizes"):
        return
    fig, ax = figs.plt.subplots(figsize=(6, 4))
    ax.plot(curve["sizes"], curve["ms"], marker="o")
    ax.set_xlabel("tokens verified in one forward (tree nodes + root)")
    ax.set_ylabel("ms")
    ax.set_xscale("log", base=2)
    ax.set_title(
        f"Verify cost curve ({report.get('device', '')})"
        + (" [given]" if curve.get("given") else "")
    )
    figs.save(fig, "cost_curve.png", "Measured verify-cost curve")


def _plot_overhead(figs: _Figures, overhead: dict | None) -> None:
    if not overhead:
        return
    batches = sorted({b for r in overhead.values() for b in r}, key=lambda b: int(b.split("_")[1]))
    fig, ax = figs.plt.subplots(figsize=(7, 4))
    _bars(
        ax,
        list(overhead),
        {
            b.replace("_", " "): [
                overhead[m].get(b, {}).get("host_ms_per_step", 0) for m in overhead
            ]
            for b in batches
        },
        "host ms per step",
    )
    ax.set_title("Host time per decode step (tiny random target)")
    figs.save(fig, "overhead.png", "Host overhead per decode step")


def _index_lines(report: dict, images: list) -> list[str]:
    """``index.md``: settings, one table per dataset, then the plots."""
    results = report.get("results", {})
    lines = [
        "# redraft-bench report",
        "",
        f"Device: {report.get('device', '?')}; torch {report.get('torch', '?')}.",
        "",
    ]
    cfg = report.get("config", {})
    if cfg:
        keys = ("target", "dtype", "datasets", "prompts", "max_new_tokens", "methods")
        lines += ["Settings: " + ", ".join(f"{k} = {cfg[k]}" for k in keys if k in cfg) + ".", ""]
    if report.get("complete") is False:
        lines += [
            "**Partial run** (stopped before its end): the figures cover the prompts each method finished.",
            "",
        ]
    skipped = report.get("skipped_prompts") or {}
    for ds, res in results.items():
        lines += [f"## {ds}", ""]
        if skipped.get(ds):
            lines += [
                f"{len(skipped[ds])} prompt(s) skipped: longer than the target's context less the new tokens.",
                "",
            ]
        lines += [
            "| method | tau | mean accepted length | tokens/s | speedup | identical to greedy |",
            "|---|---:|---:|---:|---:|:---:|",
        ]
        for m, r in res.items():
            tau = "-" if r.get("tokens_per_call") is None else f"{r['tokens_per_call']:.2f}"
            mal = (
                "-" if r.get("mean_accepted_length") is None else f"{r['mean_accepted_length']:.2f}"
            )
            failed = (
                f"; failed after {r.get('prompts', 0)} prompt(s): {r['error'][:120]}"
                if r.get("error")
                else ""
            )
            lines.append(
                f"| {m} | {tau} | {mal} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | "
                f"{r['identical_prompts']}{failed} |"
            )
        lines.append("")
    for title, name in images:
        lines += [f"## {title}", "", f"![{title}]({name})", ""]
    return lines
