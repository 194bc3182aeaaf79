"""``redraft-build-ngrams``: build n-gram draft tables for a target.

    redraft-build-ngrams --target default --kinds unigram,bigram,extended,trigram \\
        --data default-chat --output-dir checkpoints/ngrams-smollm2

    # a corpus too large for one job: N shards anywhere, then one merge
    redraft-build-ngrams --target T --kinds trigram --data SPEC --output-dir DIR --num-shards 8 --shard-id 3
    redraft-build-ngrams merge --output-dir DIR                    # finds DIR/trigram-counts-*-of-*

Every flag is documented in ``--help``; docs/ngrams.md is the guide.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import resource
import sys
import time
from pathlib import Path

from redraft.errors import ConfigError, RedraftError
from redraft.ngrams.tables import KINDS, META_FILE, save_tables

logger = logging.getLogger("redraft.ngrams")


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ConfigError(f"unknown n-gram kind(s) {bad or text!r} in --kinds; use a comma-separated "
                          f"subset of {','.join(KINDS)}.")
    return kinds


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def shard_dir(output_dir, shard_id: int, num_shards: int) -> Path:
    """Where shard ``shard_id`` of ``num_shards`` writes its partial tri-gram counts."""
    return Path(output_dir) / f"trigram-counts-{shard_id:05d}-of-{num_shards:05d}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="redraft-build-ngrams",
        description="Build n-gram draft tables (model unigram/bigram/extended from the target's "
                    "weights, ADED corpus tri-grams) into an artifact directory the decoder loads. "
                    "Subcommand `merge` combines the partial counts of a sharded tri-gram build.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="default",
                   help="target model: 'default' (SmolLM2-135M-Instruct), a .gguf file, a local HF "
                        "directory or a hub id; the tables are valid for its tokenizer only")
    p.add_argument("--kinds", default="unigram,bigram,extended,trigram",
                   help=f"comma-separated tables to build, from {','.join(KINDS)}")
    p.add_argument("--data", default="default-chat",
                   help="corpus for the tri-gram table, a redraft.data spec: default-chat, "
                        "default-code, sharegpt:PATH, code-dir:DIR?glob=*.py, hub datasets, mixtures")
    p.add_argument("--split", default="train", choices=["train", "heldout", "all"],
                   help="which records of --data to count (heldout = the evaluation prompts)")
    p.add_argument("--limit", type=int, default=None, help="use at most this many records of --data")
    p.add_argument("--output-dir", required=True, help="artifact directory (created; other kinds "
                   "already in it are kept)")
    p.add_argument("-k", type=int, default=25, help="successors per token in the unigram/bigram tables")
    p.add_argument("-w", type=int, default=10, help="tokens per extended-bigram chain")
    p.add_argument("-t", type=int, default=12, help="successors kept per tri-gram context")
    p.add_argument("--min-count", type=int, default=2,
                   help="drop tri-grams seen fewer times (1 keeps all; 2 halves the table)")
    p.add_argument("--extend-with-model", action="store_true",
                   help="chain extended rows by greedy decoding with the target instead of the "
                        "bigram table (vocab*k generations: for GPUs)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="compute dtype of the bigram forward (bf16 uses AMX/tensor cores)")
    p.add_argument("--batch-size", type=int, default=1024, help="tokens per bigram forward")
    p.add_argument("--device", default=None, help="torch device for the target (default: cuda if available)")
    p.add_argument("--num-shards", type=int, default=1,
                   help="split the tri-gram corpus into this many shards (records i with "
                        "i %% N == shard-id); each shard writes partial counts, `merge` finishes")
    p.add_argument("--shard-id", type=int, default=0, help="this job's shard, 0..num-shards-1")
    p.add_argument("--memory-mb", type=int, default=4096,
                   help="memory budget for tri-gram counts; beyond it sorted runs spill to disk")
    p.add_argument("--spill-dir", default=None,
                   help="where tri-gram counts beyond --memory-mb go (default: the system temp dir)")
    p.add_argument("--chunk-tokens", type=int, default=1 << 25,
                   help="tokens sorted at a time (about 24 bytes of memory each)")
    p.add_argument("--num-proc", type=int, default=None, help="tokenizer processes (redraft.data)")
    p.add_argument("--overwrite", action="store_true",
                   help="rebuild kinds already present in --output-dir (default: skip them)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for the bigram build (default: torch's choice, one per "
                        "core; on a machine shared with other jobs 1 can be faster)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def build_merge_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="redraft-build-ngrams merge",
        description="Combine the partial tri-gram counts of `--num-shards N` jobs into the "
                    "tri-gram table of --output-dir (equal to a single unsharded build).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--output-dir", required=True, help="artifact directory to write the table into")
    p.add_argument("--shards", nargs="*", default=None,
                   help="shard count directories (default: OUTPUT_DIR/trigram-counts-*-of-*)")
    p.add_argument("-t", type=int, default=12, help="successors kept per context")
    p.add_argument("--min-count", type=int, default=2, help="drop tri-grams seen fewer times")
    p.add_argument("--memory-mb", type=int, default=4096, help="memory budget of the range merge")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _done(out: Path, kind: str) -> bool:
    import json

    try:
        return kind in json.loads((out / META_FILE).read_text()).get("files", {})
    except (OSError, ValueError):
        return False


def run_build(args) -> dict:
    """Build the requested kinds; returns the ``ngrams.json`` fields written."""
    import torch

    from redraft.models import load_target
    from redraft.ngrams import model_tables as mt
    from redraft.ngrams.trigrams import build_trigram_table, count_trigrams

    kinds = _kinds(args.kinds)
    out = Path(args.output_dir)
    progress = not args.quiet
    if not 0 <= args.shard_id < args.num_shards:
        raise ConfigError(f"--shard-id {args.shard_id} is not in 0..{args.num_shards - 1} (--num-shards {args.num_shards}).")
    if args.num_shards > 1 and kinds != ["trigram"]:
        raise ConfigError("--num-shards shards the tri-gram corpus only: pass --kinds trigram, and build "
                          "the model tables in one unsharded run into the same --output-dir.")
    if "extended" in kinds and "bigram" not in kinds and not _done(out, "bigram"):
        raise ConfigError(f"--kinds extended chains the bigram table: add bigram to --kinds "
                          f"(none in {out} yet).")
    for name in ("k", "w", "t", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}.")
    todo = [k for k in kinds if args.overwrite or args.num_shards > 1 or not _done(out, k)]
    for k in kinds:
        if k not in todo:
            logger.warning("%s: %s table exists, skipped (pass --overwrite to rebuild it)", out, k)
    if not todo:
        return {}
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype="float32", device=args.device)
    base = dict(target.artifact_metadata(), vocab_size=target.vocab_size)
    # The flags that shaped each kind, recorded in ngrams.json beside it.
    flags = {"unigram": ("target", "k"), "bigram": ("target", "k", "dtype", "batch_size"),
             "extended": ("w", "extend_with_model", "dtype"),
             "trigram": ("data", "split", "limit", "t", "min_count", "memory_mb", "chunk_tokens")}
    seconds: dict[str, float] = {}
    written: dict = {}

    def save(kind: str, fields: dict, **tables) -> None:
        """Write one kind's table and its ngrams.json fields (merged into what is there)."""
        meta = dict(base, build_seconds={kind: round(seconds[kind], 2)},
                    build_args={kind: {f: getattr(args, f) for f in flags[kind]}}, **fields)
        save_tables(out, meta, **tables)
        written.update(meta)

    bigram = None
    if "unigram" in todo:
        t0 = time.perf_counter()
        uni = mt.build_unigram(target, args.k)
        seconds["unigram"] = time.perf_counter() - t0
        save("unigram", {"k": args.k, "unigram": {"k": int(len(uni[0]))}}, unigram=uni)
    if "bigram" in todo:
        t0 = time.perf_counter()
        bigram = mt.build_bigram(target, args.k, batch_size=args.batch_size, dtype=args.dtype,
                                 progress=progress)
        seconds["bigram"] = time.perf_counter() - t0
        save("bigram", {"k": args.k, "bigram": {"k": args.k, "dtype": args.dtype,
                                                "bos_prefix": mt.bigram_context(target.tokenizer)}},
             bigram=bigram)
        logger.info("bigram table: %.1f s", seconds["bigram"])
    if "extended" in todo:
        if bigram is None:
            from redraft.ngrams.tables import NGramTables

            ids = NGramTables.load(out, target=target, kinds=["bigram"]).table("bigram")["ids"]
        else:
            ids = bigram[0]
        t0 = time.perf_counter()
        if args.extend_with_model:
            ext = mt.build_extended_with_model(target, ids, args.w, batch_size=args.batch_size,
                                               dtype=args.dtype, progress=progress)
        else:
            ext = mt.build_extended(ids, args.w)
        seconds["extended"] = time.perf_counter() - t0
        save("extended", {"w": args.w, "extended": {"w": args.w, "k": int(ext.shape[1]),
                                                    "with_model": bool(args.extend_with_model)}},
             extended=ext)
    if "trigram" in todo:
        from redraft.data import iter_token_arrays

        t0 = time.perf_counter()
        arrays = iter_token_arrays(args.data, target.tokenizer, split=args.split, limit=args.limit,
                                   num_proc=args.num_proc, progress=progress)
        if args.num_shards > 1:
            arrays = itertools.islice(arrays, args.shard_id, None, args.num_shards)
        counts = count_trigrams(arrays, target.vocab_size, chunk_tokens=args.chunk_tokens,
                                memory_mb=args.memory_mb, spill_dir=args.spill_dir, progress=progress)
        t_count = time.perf_counter() - t0
        if args.num_shards > 1:
            d = counts.save(shard_dir(out, args.shard_id, args.num_shards), meta={
                "tokenizer_fingerprint": target.fingerprint, "target_model": target.model_id,
                "data": args.data, "split": args.split, "num_shards": args.num_shards,
                "shard_id": args.shard_id, "count_seconds": round(t_count, 2)})
            logger.warning("shard %d/%d: %s tokens counted in %.1f s → %s; run `redraft-build-ngrams "
                           "merge --output-dir %s` when all shards are done", args.shard_id,
                           args.num_shards, f"{counts.stats['tokens']:,}", t_count, d, out)
            return {"shard_dir": str(d), "stats": counts.stats}
        table = build_trigram_table(counts, t=args.t, min_count=args.min_count, progress=progress)
        seconds["trigram"] = time.perf_counter() - t0
        save("trigram", {"t": args.t, "trigram": {
            "t": args.t, "min_count": args.min_count, "data": args.data, "split": args.split,
            "corpus": table.stats, "count_seconds": round(t_count, 2),
            "table_bytes": table.nbytes(), "peak_rss_mb": round(_peak_rss_mb(), 1)}},
             trigram=table)
        logger.info("tri-gram table: %s contexts, %s entries, %.1f s", f"{table.stats['contexts']:,}",
                    f"{table.stats['entries']:,}", seconds["trigram"])
    return written


def run_merge(args) -> dict:
    """Merge shard counts in ``args.output_dir`` (or ``args.shards``) into its tri-gram table."""
    import json

    from redraft.ngrams.trigrams import _open_run, build_trigram_table, load_counts

    out = Path(args.output_dir)
    shards = [Path(s) for s in args.shards] if args.shards else sorted(out.glob("trigram-counts-*-of-*"))
    shards = [s for s in shards if ".tmp" not in s.name]
    if not shards:
        raise ConfigError(f"no shard counts found in {out} (trigram-counts-*-of-*); run the shards "
                          f"with --num-shards N --shard-id i --output-dir {out} first, or pass --shards.")
    t0 = time.perf_counter()
    counts = load_counts(shards, memory_mb=args.memory_mb)
    first = _open_run(shards[0])[2]
    table = build_trigram_table(counts, t=args.t, min_count=args.min_count, progress=not args.quiet)
    seconds = time.perf_counter() - t0
    meta = {"tokenizer_fingerprint": first.get("tokenizer_fingerprint"),
            "target_model": first.get("target_model"), "vocab_size": counts.vocab_size,
            "t": args.t, "build_seconds": {"trigram_merge": round(seconds, 2)},
            "trigram": {"t": args.t, "min_count": args.min_count, "data": first.get("data"),
                        "split": first.get("split"), "corpus": table.stats,
                        "shards": len(shards),
                        "count_seconds_per_shard": [json.loads((s / "meta.json").read_text()).get("count_seconds")
                                                    for s in shards]}}
    save_tables(out, meta, trigram=table)
    logger.warning("merged %d shards: %s contexts, %s entries in %.1f s → %s", len(shards),
                   f"{table.stats['contexts']:,}", f"{table.stats['entries']:,}", seconds, out)
    return meta


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if argv[:1] == ["merge"]:
            run_merge(build_merge_parser().parse_args(argv[1:]))
        else:
            if argv[:1] == ["build"]:
                argv = argv[1:]
            run_build(build_parser().parse_args(argv))
    except RedraftError as exc:
        print(f"redraft-build-ngrams: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
