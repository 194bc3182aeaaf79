"""Benchmark of the data pipeline: records/s and tokens/s, cold and cached.

    python -m redraft.bench.data                      # default target, default ShareGPT
    python -m redraft.bench.data --subset 300 --skip-full --output /tmp/data-bench.json

Measured in one run, on the same records:
  * baseline: the straightforward way — per conversation, ``apply_chat_template(tokenize=True)``
    of the whole chat and of every growing prefix (the token-level mask derivation), one call at
    a time;
  * candidate: :func:`redraft.data.build_token_dataset` on the same records with 1 and with
    ``--num-proc`` workers (fresh cache), reported as speedups over the baseline;
then the full default ShareGPT cold (fresh cache folder) and again from the cache, and
:func:`redraft.data.iter_token_arrays` (what the tri-gram builder reads) cold and cached.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _baseline(tokenizer, records) -> tuple[float, int]:
    """Seconds and tokens for the naive growing-prefix tokenization of ``records``."""

    def ids(messages, gen):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
        return out["input_ids"] if hasattr(out, "keys") else out

    t0 = time.perf_counter()
    n_tokens = 0
    for r in records:
        full = ids(r.messages, False)
        for k, m in enumerate(r.messages):
            if m["role"] == "assistant":
                ids(r.messages[:k], True)
                ids(r.messages[: k + 1], False)
        n_tokens += len(full)
    return time.perf_counter() - t0, n_tokens


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its reaped children (the tokenizer workers)."""
    import resource

    return sum(
        getattr(resource.getrusage(who), f)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for f in ("ru_utime", "ru_stime")
    )


def _timed_build(fn, **kw) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(**kw)
    return time.perf_counter() - t0, out


def _parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = argparse.ArgumentParser(
        prog="python -m redraft.bench.data", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--target",
        default="default",
        help="target whose tokenizer and template are used (default: %(default)s)",
    )
    p.add_argument("--data", default="default-chat", help="chat data spec (default: %(default)s)")
    p.add_argument(
        "--subset",
        type=int,
        default=500,
        help="records for the baseline comparison (default: %(default)s)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=2048,
        help="max_length of build_token_dataset (default: %(default)s)",
    )
    p.add_argument(
        "--num-proc", type=int, default=None, help="worker processes (default: CPU count)"
    )
    p.add_argument("--skip-full", action="store_true", help="only the subset comparison")
    p.add_argument("--output", default=None, help="also write the figures to this JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    from redraft.data import iter_records
    from redraft.data.records import DataStats
    from redraft.models import load_target

    num_proc = args.num_proc or min(os.cpu_count() or 1, 8)
    tok = load_target(args.target, device="cpu").tokenizer
    records = list(iter_records(args.data, limit=args.subset, stats=DataStats()))
    results: dict = {
        "target": args.target,
        "data": args.data,
        "cpus": os.cpu_count(),
        "num_proc": num_proc,
        "max_length": args.max_length,
    }
    root = Path(tempfile.mkdtemp(prefix="redraft-data-bench-"))
    try:
        _bench_subset(results, args, tok, records, num_proc, root)
        if not args.skip_full:
            _bench_iter_records(results, args)
            _bench_full(results, args, tok, num_proc, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))
    return 0


def _bench_subset(results: dict, args, tok, records: list, num_proc: int, root: Path) -> None:
    """The baseline on the subset, then build_token_dataset on it with 1 and num_proc workers."""
    from redraft.data import build_token_dataset

    n = len(records)
    base_s, base_tok = _baseline(tok, records)
    results["subset"] = {
        "records": n,
        "baseline_s": round(base_s, 3),
        "baseline_records_per_s": round(n / base_s, 1),
    }
    print(
        f"subset of {n} records, baseline (apply_chat_template per prefix): {base_s:.2f} s, "
        f"{n / base_s:,.0f} records/s, {base_tok / base_s:,.0f} tokens/s"
    )
    for procs in sorted({1, num_proc}):
        secs, ds = _timed_build(
            build_token_dataset,
            spec=args.data,
            tokenizer=tok,
            split="all",
            max_length=args.max_length,
            limit=n,
            num_proc=procs,
            cache_dir=root / f"subset-{procs}",
            progress=False,
        )
        results["subset"][f"num_proc_{procs}_s"] = round(secs, 3)
        results["subset"][f"num_proc_{procs}_speedup"] = round(base_s / secs, 2)
        print(
            f"  build_token_dataset num_proc={procs}: {secs:.2f} s, {n / secs:,.0f} records/s "
            f"-> {base_s / secs:.1f}x the baseline"
        )


def _bench_iter_records(results: dict, args) -> None:
    """iter_records over the whole data: streaming parse and validation alone."""
    from redraft.data import iter_records
    from redraft.data.records import DataStats

    stats = DataStats()
    t0 = time.perf_counter()
    n_read = sum(1 for _ in iter_records(args.data, stats=stats))
    secs = time.perf_counter() - t0
    results["iter_records"] = {
        "records": n_read,
        "seconds": round(secs, 2),
        "records_per_s": round(n_read / secs),
        "summary": stats.summary(),
    }
    print(
        f"iter_records on all of {args.data}: {n_read:,} records in {secs:.2f} s "
        f"({n_read / secs:,.0f} records/s; streaming JSON parse + validation)"
    )


def _bench_full(results: dict, args, tok, num_proc: int, root: Path) -> None:
    """build_token_dataset and iter_token_arrays over the whole data, cold and cached."""
    from redraft.data import build_token_dataset, iter_token_arrays

    for name, fn, kw in (
        (
            "build_token_dataset",
            build_token_dataset,
            dict(split="all", max_length=args.max_length),
        ),
        (
            "iter_token_arrays",
            lambda **k: sum(len(a) for a in iter_token_arrays(**k)),
            dict(split="all"),
        ),
    ):
        _bench_cold_and_cached(results, args, tok, num_proc, root / name, name, fn, kw)


def _bench_cold_and_cached(results, args, tok, num_proc, cache: Path, name: str, fn, kw) -> None:
    """One builder run twice on one cache folder: cold (with its CPU time), then cached."""

    def build():
        return _timed_build(
            fn,
            spec=args.data,
            tokenizer=tok,
            num_proc=num_proc,
            cache_dir=cache,
            progress=False,
            **kw,
        )

    cpu0 = _cpu_seconds()
    cold, out = build()
    cpu = _cpu_seconds() - cpu0
    warm, out2 = build()  # the same build again: read from the cache
    meta = json.loads(next(cache.glob("*/meta.json")).read_text())
    rec, toks = meta["records"], meta["tokens"]
    results[name] = {
        "records": rec,
        "rows": meta["rows"],
        "tokens": toks,
        "cold_s": round(cold, 2),
        "cached_s": round(warm, 2),
        "cold_records_per_s": round(rec / cold, 1),
        "cold_cpu_s": round(cpu, 1),
        "load_average": os.getloadavg()[0],
        "cold_tokens_per_s": round(toks / cold),
        "summary": meta["summary"],
    }
    print(
        f"{name} on all of {args.data}: {rec:,} records, {toks:,} tokens; cold {cold:.1f} s "
        f"({rec / cold:,.0f} records/s, {toks / cold:,.0f} tokens/s); cached {warm:.2f} s "
        f"({cold / warm:.0f}x faster)"
    )
    print(
        f"  cold build used {cpu:.1f} CPU-seconds (all processes) = {cpu / num_proc:.1f} s on "
        f"{num_proc} otherwise idle cores; load average now {os.getloadavg()[0]:.1f}"
    )
    print(f"  {meta['summary']}")


if __name__ == "__main__":
    sys.exit(main())
