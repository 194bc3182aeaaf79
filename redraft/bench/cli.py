"""``redraft-bench``: decoding methods side by side, in one run, on the same prompts.

    redraft-bench --recipe infer/bench-default.yaml
    redraft-bench --target default --datasets chat,code --prompts 20 --methods greedy,hf-prompt-lookup,ngrammys,mix \\
        --ngrams checkpoints/ngrams-smollm2 --drafter checkpoints/redrafter-smollm2 --out bench.json --report bench/
    redraft-bench --overhead --out overhead.json        # host time per decode step (tiny target)

Every method decodes every prompt; prompts are the outer loop so machine noise hits all methods
alike, and every figure is reported against plain greedy (ours) measured in the same run:
``tokens_per_call`` (tau, prefill included), ``mean_accepted_length`` (vLLM / Spec-Bench:
accepted draft tokens + 1 per verify step), ``acceptance_per_position``, ``tokens_per_s``,
``speedup_vs_ar`` and ``identical_to_ar`` (the output equals plain greedy token for token).

``--out`` and ``--markdown`` are written (atomically) after every prompt, so a run stopped at
a time limit keeps what it measured (``"complete": false`` until the end); a method that raises
is reported with its error and left out of the later prompts (exit code 1 at the end); a prompt
longer than the target's context less ``--max-new-tokens`` is skipped with a note
(``skipped_prompts``).

Methods come from one explicit registry (:mod:`redraft.bench.methods`; ``--list-methods``
prints it with what each needs); a requested method that cannot run (a missing artifact, a
table without the kind it needs) is an error before any work. Settings are
:mod:`redraft.bench.config`'s; the runner is :mod:`redraft.bench.run`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from redraft.bench.concurrent import run_concurrent
from redraft.bench.config import (  # noqa: F401 (the CLI's API)
    BENCH_DEFAULTS,
    build_parser,
    check_outputs,
    resolve_artifacts,
    resolve_config,
    twin_config,
)
from redraft.bench.methods import METHOD_NAMES, REGISTRY, Method, check_methods, list_methods  # noqa: F401
from redraft.bench.prompts import dataset_label, fit_context
from redraft.bench.run import (  # noqa: F401
    Context,
    Runner,
    cost_curve,
    device_name,
    markdown,
    run_dataset,
)
from redraft.cli import run_cli
from redraft.data.prompts import MT_BENCH_HINT, load_prompts  # noqa: F401
from redraft.errors import ConfigError


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # recorded with --results-dir
    return run_cli("redraft-bench", lambda: _main(args))


def _main(args) -> int:
    """The run ``main`` wraps in run_cli (a RedraftError: one line, exit 2; Ctrl-C: exit 130)."""
    bench, cfg = resolve_config(args)
    bench = {**bench, "recipe": args.recipe, "argv": getattr(args, "argv", [])}
    if args.list_methods:
        print(list_methods())
        return 0
    check_outputs(bench)
    twin_config(bench, cfg)  # a bad --twin fails before any work
    if args.from_json:
        return _from_json(Path(args.from_json), bench)
    from redraft.utils import resolve_device

    device = resolve_device(bench["device"])
    import torch

    if bench["threads"]:
        torch.set_num_threads(int(bench["threads"]))
    if bench["overhead"]:
        return _overhead(bench, device)
    return _decode_tables(bench, cfg, device)


def _load(bench: dict, cfg, device):
    """The target and the artifacts (checked before the target loads), as a method Context."""
    methods = list(dict.fromkeys(["greedy"] + bench["methods"]))
    drafter_dirs, ngram_dirs, have = resolve_artifacts(bench)
    check_methods(methods, have)
    from redraft.infer.loader import load_ngram_tables, load_redrafter
    from redraft.models import load_target

    target = load_target(bench["target"], dtype=bench["dtype"], device=device)
    tables = [load_ngram_tables(p, target) for p in ngram_dirs]
    heads = [
        load_redrafter(
            p,
            target,
            cfg.redrafter_width,
            cfg.redrafter_length,
            name="redrafter" if len(drafter_dirs) == 1 else f"redrafter{i}",
        )
        for i, p in enumerate(drafter_dirs)
    ]
    return methods, Context(target, tables, heads, cfg, bench, bench["retrieval_index"])


def _decode_tables(bench: dict, cfg, device) -> int:
    """Every method on every dataset, the tables written as they grow; 1 if a method failed."""
    methods, ctx = _load(bench, cfg, device)
    runners = _with_twins({m: Runner(m, ctx, REGISTRY[m]) for m in methods}, ctx)
    report = _new_report(bench, cfg, ctx, runners)
    context = getattr(ctx.target.model.config, "max_position_embeddings", None)
    for ds in bench["datasets"]:
        _decode_dataset(report, runners, bench, ds, context)
    report["complete"] = True
    md = _markdown(report, bench)
    print(md)
    _outputs(report, md, bench)
    if bench["results_dir"]:
        _write_results(report, md, bench)
    return _failed_methods(report)


def _with_twins(runners: dict, ctx) -> dict:
    """``runners`` with, after each of redraft's methods, its twin decoding with the ``--twin``
    setting changed (prompt-major: the two decode each prompt one after the other)."""
    twin = twin_config(ctx.bench, ctx.cfg)
    if twin is None:
        return runners
    label, cfg = twin
    out = {}
    for name, r in runners.items():
        out[name] = r
        if r.decoder is not None:
            out[f"{name} {label}"] = Runner(f"{name} {label}", ctx, REGISTRY[name], cfg=cfg)
    return out


def _new_report(bench: dict, cfg, ctx, runners: dict) -> dict:
    """The report before any prompt: the config, the device, the cost curve, no results."""
    import torch

    from redraft.infer.spec import hostjit

    return {
        "config": {**bench, "decoder": cfg.to_dict()},
        "device": ", ".join(
            filter(
                None,
                [
                    device_name(ctx.target.device),
                    runners["greedy"].decoder.verifier.kernels,
                    f"host kernels: {hostjit.status()}",
                ],
            )
        ),
        "torch": torch.__version__,
        "cost_curve_ms": cost_curve(runners, bench),
        "complete": False,
        "results": {},
        "skipped_prompts": {},
    }


def _markdown(report: dict, bench: dict) -> str:
    """The report's tables as markdown."""
    return markdown(
        report["results"],
        bench,
        report["device"],
        report["skipped_prompts"],
        report.get("concurrent"),
    )


def _decode_dataset(report: dict, runners: dict, bench: dict, ds: str, context) -> None:
    """One dataset: its prompts by every method, alone and at each concurrency asked for."""
    label = dataset_label(ds) + (f" x{bench['repeat']}" if bench["repeat"] > 1 else "")
    prompts = _fitted_prompts(report, runners, bench, ds, label, context)
    # every prompt again after the whole set: earlier requests' outputs matter (the suffix
    # drafter's global tree, vLLM's suffix cache), and no request directly follows its twin
    prompts = prompts * bench["repeat"]

    def partial(res, label=label):  # after every prompt: what was measured survives a stop
        report["results"][label] = res
        _outputs(report, _markdown(report, bench), {**bench, "report": None})

    report["results"][label] = (
        run_dataset(runners, prompts, bench, ds, on_prompt=partial)
        if 1 in bench["concurrency"]
        else {}  # only the concurrent runs were asked for
    )
    for c in (c for c in bench["concurrency"] if c > 1):
        conc = report.setdefault("concurrent", {}).setdefault(label, {})
        conc[str(c)] = run_concurrent(runners, prompts, bench, c)
        partial(report["results"][label])


def _fitted_prompts(report: dict, runners: dict, bench: dict, ds: str, label: str, context) -> list:
    """The dataset's prompts, encoded, less those too long for the context (noted in the report)."""
    encoded = [
        runners["greedy"].decoder.encode(p)[0]
        for p in load_prompts(ds, bench["prompts"], bench["chat_spec"])
    ]
    prompts, skipped = fit_context(encoded, context, bench["max_new_tokens"], ds)
    if skipped:
        print(
            f"redraft-bench: {ds}: {len(skipped)} of {len(encoded)} prompts skipped, longer than the target's "
            f"context ({context} tokens) less --max-new-tokens {bench['max_new_tokens']}",
            file=sys.stderr,
        )
        report["skipped_prompts"][label] = [{**x, "context": context} for x in skipped]
    return prompts


def _write_results(report: dict, md: str, bench: dict) -> None:
    """The run under --results-dir, with its metadata."""
    from redraft.bench.results import run_metadata, write_result

    name = Path(bench["recipe"]).stem if bench.get("recipe") else "redraft-bench"
    meta = run_metadata(bench.get("argv", []))
    paths = write_result(bench["results_dir"], name, report, md, meta)
    print(f"results: {', '.join(map(str, paths))}")


def _failed_methods(report: dict) -> int:
    """The exit code: 1 (with their names) if a method failed on some prompt, else 0."""
    failed = sorted(
        {m for res in report["results"].values() for m, r in res.items() if r.get("error")}
    )
    if failed:
        print(
            f"redraft-bench: methods that failed (see their error in the table): {', '.join(failed)}",
            file=sys.stderr,
        )
        return 1
    return 0


def _write(path, text: str) -> None:
    from redraft.utils import atomic_write_text

    atomic_write_text(path, text)


def _outputs(report: dict, md: str, bench: dict) -> None:
    if bench["out"]:
        _write(bench["out"], json.dumps(report, indent=2))
    if bench["markdown"]:
        _write(bench["markdown"], md)
    if bench["report"]:
        from redraft.bench.report import write_report

        index = write_report(report, bench["report"])
        print(f"report: {index}")


def _from_json(path: Path, bench: dict) -> int:
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--from-json {path}: cannot read it ({exc}).", param="from_json"
        ) from exc
    if "results" not in report and "overhead" not in report:
        raise ConfigError(
            f"--from-json {path} is not a redraft-bench --out file (no 'results' or 'overhead')."
        )
    md = (
        markdown(
            report["results"],
            {**bench, **report.get("config", {})},
            report.get("device", "?"),
            report.get("skipped_prompts"),
        )
        if "results" in report
        else ""
    )
    _outputs(report, md, {**bench, "out": None})
    return 0


def _overhead(bench: dict, device) -> int:
    from redraft.bench.overhead import overhead_benchmark, overhead_markdown

    result = overhead_benchmark(
        device=device,
        dtype=bench["dtype"],
        batches=bench["overhead_batches"],
        new_tokens=bench["overhead_tokens"],
        kernels=bench["overhead_kernels"],
    )
    import torch

    desc = device_name(device)
    result.update(
        device=desc,
        torch=torch.__version__,
        config={
            "dtype": bench["dtype"],
            "new_tokens": bench["overhead_tokens"],
            "kernels": bench["overhead_kernels"],
        },
    )
    md = overhead_markdown(result, desc)
    print(md)
    _outputs(result, md, bench)
    return 0
