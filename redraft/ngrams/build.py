"""The steps of ``redraft-build-ngrams`` (:func:`redraft.ngrams.cli.run_build` runs them in
order): load the target, build each requested kind, write it with its ``ngrams.json`` fields
(:class:`TableWriter`), or, for one shard of a sharded tri-gram build, save its partial counts.
"""

from __future__ import annotations

import itertools
import logging
import resource
import time
from pathlib import Path

from redraft.errors import ConfigError, DataError
from redraft.ngrams.format import shard_dir_name

logger = logging.getLogger("redraft.ngrams")

# The flags that shaped each kind, recorded in ngrams.json (build_args) beside it.
BUILD_FLAGS = {
    "unigram": ("target", "k"),
    "bigram": ("target", "k", "dtype", "batch_size"),
    "extended": ("w", "extend_with_model", "dtype"),
    "trigram": ("target", "data", "split", "limit", "t", "min_count", "memory_mb", "chunk_tokens"),
}


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def shard_dir(output_dir, shard_id: int, num_shards: int) -> Path:
    """Where shard ``shard_id`` of ``num_shards`` writes its partial tri-gram counts."""
    return Path(output_dir) / shard_dir_name(shard_id, num_shards)


def check_vocab_bounds(args, vocab_size: int) -> None:
    for name in ("k", "t"):
        if getattr(args, name) > vocab_size:
            raise ConfigError(
                f"-{name} {getattr(args, name)} is above the target's vocabulary "
                f"size {vocab_size}: choose 1..{vocab_size}.",
                param=name,
            )


def load_build_target(args):
    """The target in float32 on ``--device`` (``--threads`` applied first)."""
    import torch

    from redraft.models import load_target
    from redraft.utils import resolve_device

    device = resolve_device(args.device)  # "cuda" without CUDA: one clear line, before the load
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype="float32", device=device)
    check_vocab_bounds(args, target.vocab_size)
    return target


class TableWriter:
    """Writes one kind's table with its ``ngrams.json`` fields (merged into what is there) and
    collects the fields written (:attr:`written`)."""

    def __init__(self, args, out: Path, target):
        self.args, self.out = args, out
        self.base = dict(target.artifact_metadata(), vocab_size=target.vocab_size)
        self.written: dict = {}

    def __call__(self, kind: str, seconds: float, fields: dict, **tables) -> None:
        from redraft.ngrams.tables import save_tables

        meta = dict(
            self.base,
            build_seconds={kind: round(seconds, 2)},
            build_args={kind: {f: getattr(self.args, f) for f in BUILD_FLAGS[kind]}},
            **fields,
        )
        save_tables(self.out, meta, **tables)
        self.written.update(meta)


def build_unigram(args, target, save: TableWriter) -> None:
    from redraft.ngrams import model_tables as mt

    t0 = time.perf_counter()
    uni = mt.build_unigram(target, args.k)
    save(
        "unigram",
        time.perf_counter() - t0,
        {"k": args.k, "unigram": {"k": int(len(uni[0]))}},
        unigram=uni,
    )


def build_bigram(args, target, save: TableWriter):
    """Build and write the model bigram; returns its ids ``[V, k]`` (the extended chains' input)."""
    from redraft.ngrams import model_tables as mt

    t0 = time.perf_counter()
    bigram = mt.build_bigram(
        target, args.k, batch_size=args.batch_size, dtype=args.dtype, progress=not args.quiet
    )
    seconds = time.perf_counter() - t0
    save(
        "bigram",
        seconds,
        {
            "k": args.k,
            "bigram": {
                "k": args.k,
                "dtype": args.dtype,
                "bos_prefix": mt.bigram_context(target.tokenizer),
            },
        },
        bigram=bigram,
    )
    logger.info("bigram table: %.1f s", seconds)
    return bigram[0]


def build_extended(args, target, out: Path, bigram_ids, save: TableWriter) -> None:
    """Extended bigram chains from ``bigram_ids`` (or the bigram table already in ``out``)."""
    from redraft.ngrams import model_tables as mt

    if bigram_ids is None:
        from redraft.ngrams.tables import NGramTables

        bigram_ids = NGramTables.load(out, target=target, kinds=["bigram"]).table("bigram")["ids"]
    t0 = time.perf_counter()
    if args.extend_with_model:
        ext = mt.build_extended_with_model(
            target,
            bigram_ids,
            args.w,
            batch_size=args.batch_size,
            dtype=args.dtype,
            progress=not args.quiet,
        )
    else:
        ext = mt.build_extended(bigram_ids, args.w)
    save(
        "extended",
        time.perf_counter() - t0,
        {
            "w": args.w,
            "extended": {
                "w": args.w,
                "k": int(ext.shape[1]),
                "with_model": bool(args.extend_with_model),
            },
        },
        extended=ext,
    )


def report_records(args, read: dict) -> None:
    """Say what reading ``--data`` skipped (as redraft-train and distill do), and refuse a
    corpus of which nothing was usable, naming why each record was skipped."""
    src = read.get("source_stats", {})
    skipped = {**src.get("skipped", {}), **read.get("tokenize_skipped", {})}
    if skipped:
        reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(skipped.items(), key=lambda kv: -kv[1]))
        logger.warning(
            "--data %s: kept %s records, skipped %s malformed or unusable ones (%s)",
            args.data,
            f"{src.get('kept', read.get('records', 0)):,}",
            f"{sum(skipped.values()):,}",
            reasons,
        )
    if read and not read.get("records"):
        why = f"every record was skipped ({reasons})" if skipped else "it holds no record"
        raise DataError(
            f"--data {args.data} (split {args.split}): no usable record, {why}. Fix the file or "
            f"choose another --data (docs/data.md lists the formats)."
        )


def build_trigram(args, target, out: Path, save: TableWriter) -> dict | None:
    """Count the corpus tri-grams and write the pruned table; for a shard of a sharded build,
    save its counts instead and return ``{shard_dir, stats}``."""
    from redraft.data import iter_token_arrays
    from redraft.ngrams.trigrams import build_trigram_table, count_trigrams

    progress = not args.quiet
    t0 = time.perf_counter()
    read: dict = {}  # what reading --data kept and skipped (filled once counting starts)
    arrays = iter_token_arrays(
        args.data,
        target.tokenizer,
        split=args.split,
        limit=args.limit,
        num_proc=args.num_proc,
        progress=progress,
        meta=read,
    )
    if args.num_shards > 1:
        arrays = itertools.islice(arrays, args.shard_id, None, args.num_shards)
    # Spilled runs go into a private folder under --spill-dir (default: the output dir, on
    # the disk the artifact goes to); the `with` below removes it on success, errors and
    # Ctrl-C, and a SIGKILLed build's folder is removed by the next build (_clean_spills).
    counts = count_trigrams(
        arrays,
        target.vocab_size,
        chunk_tokens=args.chunk_tokens,
        memory_mb=args.memory_mb,
        spill_dir=args.spill_dir or out,
        progress=progress,
    )
    with counts:
        report_records(args, read)
        t_count = time.perf_counter() - t0
        if args.num_shards > 1:
            return save_shard(args, target, out, counts, t_count)
        table = build_trigram_table(counts, t=args.t, min_count=args.min_count, progress=progress)
    seconds = time.perf_counter() - t0
    save(
        "trigram",
        seconds,
        {
            "t": args.t,
            "trigram": {
                "t": args.t,
                "min_count": args.min_count,
                "data": args.data,
                "split": args.split,
                "corpus": table.stats,
                "count_seconds": round(t_count, 2),
                "table_bytes": table.nbytes(),
                "peak_rss_mb": round(peak_rss_mb(), 1),
            },
        },
        trigram=table,
    )
    logger.info(
        "tri-gram table: %s contexts, %s entries, %.1f s",
        f"{table.stats['contexts']:,}",
        f"{table.stats['entries']:,}",
        seconds,
    )
    return None


def save_shard(args, target, out: Path, counts, t_count: float) -> dict:
    """One shard's partial counts into its directory under ``out`` (``merge`` combines them)."""
    d = counts.save(
        shard_dir(out, args.shard_id, args.num_shards),
        meta=dict(
            target.artifact_metadata(),
            data=args.data,
            split=args.split,
            limit=args.limit,
            num_shards=args.num_shards,
            shard_id=args.shard_id,
            count_seconds=round(t_count, 2),
            build_args={f: getattr(args, f) for f in BUILD_FLAGS["trigram"]},
        ),
    )
    return {"shard_dir": str(d), "stats": counts.stats, "count_seconds": t_count}
