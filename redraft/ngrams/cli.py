"""``redraft-build-ngrams``: build n-gram draft tables for a target.

    redraft-build-ngrams --target default --kinds unigram,bigram,extended,trigram \\
        --data default-chat --output-dir checkpoints/ngrams-smollm2

    # a corpus too large for one job: N shards anywhere, then one merge
    redraft-build-ngrams --target T --kinds trigram --data SPEC --output-dir DIR --num-shards 8 --shard-id 3
    redraft-build-ngrams merge --output-dir DIR      # finds DIR/trigram-counts-*-of-*, then moves them to DIR.shards

Every flag is documented in ``--help``; docs/ngrams.md is the guide. Arguments, the output
directory and the device are checked before any work; an error is one line on stderr and exit
status 2, Ctrl-C exit status 130, and neither leaves temporary files behind. This module imports
no torch at import time (``--help`` is instant).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import resource
import shutil
import signal
import sys
import time
from pathlib import Path

from redraft.errors import ConfigError, DataError, RedraftError
from redraft.ngrams.format import KINDS, META_FILE, SHARD_GLOB, SHARDS_SUFFIX, shard_dir_name
from redraft.utils import ArgumentParser, HelpFormatter

logger = logging.getLogger("redraft.ngrams")
PROG = "redraft-build-ngrams"

# The flags that shaped each kind, recorded in ngrams.json (build_args) beside it.
BUILD_FLAGS = {"unigram": ("target", "k"), "bigram": ("target", "k", "dtype", "batch_size"),
               "extended": ("w", "extend_with_model", "dtype"),
               "trigram": ("target", "data", "split", "limit", "t", "min_count", "memory_mb",
                           "chunk_tokens")}


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ConfigError(f"unknown n-gram kind(s) {bad or text!r} in --kinds; use a comma-separated "
                          f"subset of {','.join(KINDS)}.", param="kinds")
    return kinds


def report_records(args, read: dict) -> None:
    """Say what reading ``--data`` skipped (as redraft-train and distill do), and refuse a
    corpus of which nothing was usable, naming why each record was skipped."""
    src = read.get("source_stats", {})
    skipped = {**src.get("skipped", {}), **read.get("tokenize_skipped", {})}
    if skipped:
        reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(skipped.items(), key=lambda kv: -kv[1]))
        logger.warning("--data %s: kept %s records, skipped %s malformed or unusable ones (%s)", args.data,
                       f"{src.get('kept', read.get('records', 0)):,}", f"{sum(skipped.values()):,}", reasons)
    if read and not read.get("records"):
        why = f"every record was skipped ({reasons})" if skipped else "it holds no record"
        raise DataError(f"--data {args.data} (split {args.split}): no usable record, {why}. Fix the file or "
                        f"choose another --data (docs/data.md lists the formats).")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def shard_dir(output_dir, shard_id: int, num_shards: int) -> Path:
    """Where shard ``shard_id`` of ``num_shards`` writes its partial tri-gram counts."""
    return Path(output_dir) / shard_dir_name(shard_id, num_shards)


def shards_home(output_dir) -> Path:
    """Where ``merge`` moves the shard counts of ``output_dir`` once the table is written."""
    out = Path(output_dir)
    return out.with_name(out.name + SHARDS_SUFFIX)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Build n-gram draft tables (model unigram/bigram/extended from the target's "
                    "weights, ADED corpus tri-grams) into an artifact directory the decoder loads. "
                    "Subcommand `merge` combines the partial counts of a sharded tri-gram build.",
        formatter_class=HelpFormatter)
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
    p.add_argument("--limit", type=int, default=None,
                   help="use at most this many records of --data (at least 1; default: all)")
    p.add_argument("--output-dir", required=True, help="artifact directory (created; other kinds "
                   "already in it are kept)")
    p.add_argument("-k", type=int, default=25,
                   help="successors per token in the unigram/bigram tables (1..vocabulary size)")
    p.add_argument("-w", type=int, default=10, help="tokens per extended-bigram chain (at least 1)")
    p.add_argument("-t", type=int, default=12,
                   help="successors kept per tri-gram context (1..vocabulary size)")
    p.add_argument("--min-count", type=int, default=2,
                   help="drop tri-grams seen fewer times (1 keeps all; 2 halves the table)")
    p.add_argument("--extend-with-model", action=argparse.BooleanOptionalAction, default=False,
                   help="chain extended rows by greedy decoding with the target instead of the "
                        "bigram table (vocab*k generations: for GPUs)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="compute dtype of the bigram forward (bf16 uses AMX/tensor cores)")
    p.add_argument("--batch-size", type=int, default=1024, help="tokens per bigram forward")
    p.add_argument("--device", default=None,
                   help="torch device for the target: cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--num-shards", type=int, default=1,
                   help="split the tri-gram corpus into this many shards (records i with "
                        "i %% N == shard-id); each shard writes partial counts, `merge` finishes")
    p.add_argument("--shard-id", type=int, default=0, help="this job's shard, 0..num-shards-1")
    p.add_argument("--memory-mb", type=int, default=4096,
                   help="memory budget for tri-gram counts; beyond it sorted runs spill to disk")
    p.add_argument("--spill-dir", default=None,
                   help="where tri-gram counts beyond --memory-mb go, in a private folder removed "
                        "at the end (default: --output-dir; a killed build's leftovers are removed "
                        "by the next build into the same place)")
    p.add_argument("--chunk-tokens", type=int, default=1 << 25,
                   help="tokens sorted at a time (about 24 bytes of memory each)")
    p.add_argument("--num-proc", type=int, default=None,
                   help="tokenizer processes (default: one per CPU, at most 8)")
    p.add_argument("--overwrite", action=argparse.BooleanOptionalAction, default=False,
                   help="rebuild kinds already present in --output-dir (default: skip them)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for the bigram build (default: torch's choice, one per "
                        "core; on a machine shared with other jobs 1 can be faster)")
    p.add_argument("--quiet", action=argparse.BooleanOptionalAction, default=False,
                   help="no progress bars")
    return p


def build_merge_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=f"{PROG} merge",
        description="Combine the partial tri-gram counts of `--num-shards N` jobs into the "
                    "tri-gram table of --output-dir (equal to a single unsharded build). The "
                    "shards' checksums are checked first. Afterwards the shard directories "
                    "inside --output-dir move to OUTPUT_DIR.shards/ (the artifact directory then "
                    "holds one artifact; a later merge finds them there).",
        formatter_class=HelpFormatter)
    p.add_argument("--output-dir", required=True, help="artifact directory to write the table into")
    p.add_argument("--shards", nargs="*", default=None,
                   help="shard count directories (default: OUTPUT_DIR/trigram-counts-*-of-*, "
                        "then OUTPUT_DIR.shards/ for a re-merge)")
    p.add_argument("-t", type=int, default=12, help="successors kept per context")
    p.add_argument("--min-count", type=int, default=2, help="drop tri-grams seen fewer times")
    p.add_argument("--memory-mb", type=int, default=4096, help="memory budget of the range merge")
    p.add_argument("--keep-shards", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the shard counts (moved to OUTPUT_DIR.shards/) for a later re-merge "
                        "with other -t/--min-count; --no-keep-shards deletes them after the merge")
    p.add_argument("--quiet", action=argparse.BooleanOptionalAction, default=False,
                   help="no progress bars")
    return p


# ------------------------------------------------------------------------------------------
# argument checks: all of them before any work


def _at_least(args, name: str, low: int, *, optional: bool = False, what: str = "") -> None:
    value = getattr(args, name)
    if optional and value is None:
        return
    if value < low:
        flag = "-" + name if len(name) == 1 else "--" + name.replace("_", "-")
        raise ConfigError(f"{flag} {value} is out of range: it must be at least {low}{what}.",
                          param=name)


def check_output_dir(path, flag: str = "--output-dir", param: str = "output_dir") -> Path:
    """Create ``path`` as a directory (or accept an existing one) and check it is writable.

    Raises:
        ConfigError: ``path`` is a file, cannot be created, or is not writable.
    """
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} is an existing file; pass a directory (it is created "
                          f"when missing).", param=param)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {path} cannot be created ({exc.strerror or exc}); pass a "
                          f"directory you can write to.", param=param) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path} is not writable; pass a directory you can write to.",
                          param=param)
    return path


def check_build_args(args) -> list[str]:
    """Every check that needs no model: the kinds, the numbers' ranges, the data spec, the
    output and spill directories. Returns the kinds."""
    kinds = _kinds(args.kinds)
    for name in ("k", "w", "t", "min_count", "batch_size", "num_shards", "chunk_tokens"):
        _at_least(args, name, 1)
    _at_least(args, "memory_mb", 0)
    _at_least(args, "limit", 1, optional=True, what=" (leave it out to use every record)")
    _at_least(args, "num_proc", 1, optional=True)
    _at_least(args, "threads", 1, optional=True)
    if not 0 <= args.shard_id < args.num_shards:
        raise ConfigError(f"--shard-id {args.shard_id} is not in 0..{args.num_shards - 1} "
                          f"(--num-shards {args.num_shards}).", param="shard_id")
    if args.num_shards > 1 and kinds != ["trigram"]:
        raise ConfigError("--num-shards shards the tri-gram corpus only: pass --kinds trigram, and "
                          "build the model tables in one unsharded run into the same --output-dir.",
                          param="num_shards")
    out = Path(args.output_dir).expanduser()
    if "extended" in kinds and "bigram" not in kinds and not _done(out, "bigram"):
        raise ConfigError(f"--kinds extended chains the bigram table: add bigram to --kinds "
                          f"(none in {out} yet).", param="kinds")
    if "trigram" in kinds:
        from redraft.data.sources import parse_spec  # light: no torch

        parse_spec(args.data)  # DataError naming the spec
    check_output_dir(out)
    if args.spill_dir is not None:
        check_output_dir(args.spill_dir, "--spill-dir", "spill_dir")
    return kinds


def _check_vocab_bounds(args, vocab_size: int) -> None:
    for name in ("k", "t"):
        if getattr(args, name) > vocab_size:
            raise ConfigError(f"-{name} {getattr(args, name)} is above the target's vocabulary "
                              f"size {vocab_size}: choose 1..{vocab_size}.", param=name)


def _done(out: Path, kind: str) -> bool:
    try:
        return kind in json.loads((out / META_FILE).read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        return False


def _clean_spills(*roots) -> None:
    """Remove spill folders of killed builds under ``roots`` (issue: they were never cleaned)."""
    from redraft.ngrams.trigrams import clean_stale_spills

    for root in {Path(r).expanduser() for r in roots if r is not None}:
        for d in clean_stale_spills(root):
            logger.warning("removed %s: spilled tri-gram counts of a build that was killed", d)


# ------------------------------------------------------------------------------------------
# build


def run_build(args) -> dict:
    """Build the requested kinds; returns the ``ngrams.json`` fields written."""
    kinds = check_build_args(args)
    out = Path(args.output_dir).expanduser()
    progress = not args.quiet
    todo = [k for k in kinds if args.overwrite or args.num_shards > 1 or not _done(out, k)]
    for k in kinds:
        if k not in todo:
            logger.warning("%s: %s table exists, skipped (pass --overwrite to rebuild it)", out, k)
    if not todo:
        return {}
    if "trigram" in todo:
        _clean_spills(out, args.spill_dir)

    import torch

    from redraft.models import load_target
    from redraft.ngrams import model_tables as mt
    from redraft.ngrams.tables import save_tables
    from redraft.ngrams.trigrams import build_trigram_table, count_trigrams
    from redraft.utils import resolve_device

    device = resolve_device(args.device)  # "cuda" without CUDA: one clear line, before the load
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype="float32", device=device)
    _check_vocab_bounds(args, target.vocab_size)
    base = dict(target.artifact_metadata(), vocab_size=target.vocab_size)
    seconds: dict[str, float] = {}
    written: dict = {}

    def save(kind: str, fields: dict, **tables) -> None:
        """Write one kind's table and its ngrams.json fields (merged into what is there)."""
        meta = dict(base, build_seconds={kind: round(seconds[kind], 2)},
                    build_args={kind: {f: getattr(args, f) for f in BUILD_FLAGS[kind]}}, **fields)
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
        read: dict = {}  # what reading --data kept and skipped (filled once counting starts)
        arrays = iter_token_arrays(args.data, target.tokenizer, split=args.split, limit=args.limit,
                                   num_proc=args.num_proc, progress=progress, meta=read)
        if args.num_shards > 1:
            arrays = itertools.islice(arrays, args.shard_id, None, args.num_shards)
        # Spilled runs go into a private folder under --spill-dir (default: the output dir, on
        # the disk the artifact goes to); the finally below removes it on success, errors and
        # Ctrl-C, and a SIGKILLed build's folder is removed by the next build (_clean_spills).
        counts = count_trigrams(arrays, target.vocab_size, chunk_tokens=args.chunk_tokens,
                                memory_mb=args.memory_mb, spill_dir=args.spill_dir or out,
                                progress=progress)
        with counts:
            report_records(args, read)
            t_count = time.perf_counter() - t0
            if args.num_shards > 1:
                d = counts.save(shard_dir(out, args.shard_id, args.num_shards), meta=dict(
                    target.artifact_metadata(), data=args.data, split=args.split,
                    limit=args.limit, num_shards=args.num_shards, shard_id=args.shard_id,
                    count_seconds=round(t_count, 2),
                    build_args={f: getattr(args, f) for f in BUILD_FLAGS["trigram"]}))
                logger.warning("shard %d/%d: %s tokens counted in %.1f s → %s; run `%s merge "
                               "--output-dir %s` when all shards are done", args.shard_id,
                               args.num_shards, f"{counts.stats['tokens']:,}", t_count, d, PROG, out)
                return {"shard_dir": str(d), "stats": counts.stats}
            table = build_trigram_table(counts, t=args.t, min_count=args.min_count,
                                        progress=progress)
        seconds["trigram"] = time.perf_counter() - t0
        save("trigram", {"t": args.t, "trigram": {
            "t": args.t, "min_count": args.min_count, "data": args.data, "split": args.split,
            "corpus": table.stats, "count_seconds": round(t_count, 2),
            "table_bytes": table.nbytes(), "peak_rss_mb": round(_peak_rss_mb(), 1)}},
             trigram=table)
        logger.info("tri-gram table: %s contexts, %s entries, %.1f s", f"{table.stats['contexts']:,}",
                    f"{table.stats['entries']:,}", seconds["trigram"])
    return written


# ------------------------------------------------------------------------------------------
# merge


def find_shards(out: Path) -> list[Path]:
    """Shard directories of ``out``: those inside it, then (for a re-merge) those a previous
    merge moved to ``out.shards``; a shard inside ``out`` replaces the moved one of its name."""
    found = {}
    for root in (shards_home(out), out):  # later wins: a rerun shard in out replaces the old
        if root.is_dir():
            for d in sorted(root.glob(SHARD_GLOB)):
                if d.is_dir() and ".tmp" not in d.name:  # a shard killed while saving
                    found[d.name] = d
    return [found[n] for n in sorted(found)]


def _move_shards_out(shards: list[Path], out: Path, keep: bool) -> None:
    """Take the shard directories out of the finished artifact directory ``out``."""
    inside = [s for s in shards if s.parent.resolve() == out.resolve()]
    if not inside:
        return
    home = shards_home(out)
    for s in inside:
        if keep:
            home.mkdir(exist_ok=True)
            shutil.rmtree(home / s.name, ignore_errors=True)  # an older copy of the same shard
            os.replace(s, home / s.name)
        else:
            shutil.rmtree(s)
    logger.warning("%s %d shard directories out of the artifact %s%s", "moved" if keep else "deleted",
                   len(inside), out, f" to {home}" if keep else "")


def run_merge(args) -> dict:
    """Merge shard counts in ``args.output_dir`` (or ``args.shards``) into its tri-gram table."""
    for name in ("t", "min_count"):
        _at_least(args, name, 1)
    _at_least(args, "memory_mb", 0)
    out = Path(args.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir {out} is an existing file; pass the directory the shards "
                          f"were written to.", param="output_dir")
    shards = [Path(s).expanduser() for s in args.shards] if args.shards else find_shards(out)
    if not shards:
        raise ConfigError(f"no shard counts found in {out} ({SHARD_GLOB}) or {shards_home(out)}; "
                          f"run the shards with --num-shards N --shard-id i --output-dir {out} "
                          f"first, or pass --shards.", param="shards")
    check_output_dir(out)
    _clean_spills(out)

    from redraft.ngrams.tables import save_tables
    from redraft.ngrams.trigrams import _open_run, build_trigram_table, load_counts

    t0 = time.perf_counter()
    counts = load_counts(shards, memory_mb=args.memory_mb)  # checksums, completeness, agreement
    first = _open_run(shards[0])[2]
    table = build_trigram_table(counts, t=args.t, min_count=args.min_count, progress=not args.quiet)
    seconds = time.perf_counter() - t0
    target_fields = {k: first[k] for k in ("target_model", "target_vocab_size", "target_hidden_size",
                                           "tokenizer_fingerprint") if k in first}
    shard_args = dict(first.get("build_args") or {k: first.get(k) for k in ("data", "split", "limit")})
    shard_args.update(t=args.t, min_count=args.min_count, memory_mb=args.memory_mb,
                      num_shards=first.get("num_shards", len(shards)))
    meta = dict(target_fields, vocab_size=counts.vocab_size, t=args.t,
                build_seconds={"trigram_merge": round(seconds, 2)},
                build_args={"trigram": shard_args},
                trigram={"t": args.t, "min_count": args.min_count, "data": first.get("data"),
                         "split": first.get("split"), "corpus": table.stats,
                         "shards": len(shards), "table_bytes": table.nbytes(),
                         "count_seconds_per_shard": [_open_run(s)[2].get("count_seconds")
                                                     for s in shards]})
    save_tables(out, meta, trigram=table)
    # Only now, with the table and ngrams.json written: a kill before this leaves the shards
    # where a rerun of the merge finds them.
    _move_shards_out(shards, out, keep=args.keep_shards)
    logger.warning("merged %d shards: %s contexts, %s entries in %.1f s → %s", len(shards),
                   f"{table.stats['contexts']:,}", f"{table.stats['entries']:,}", seconds, out)
    return meta


# ------------------------------------------------------------------------------------------


_MAIN_PID = os.getpid()


def _terminate(signum, frame):
    """SIGTERM in the CLI process: exit through the finally blocks (temporary files), like
    Ctrl-C. A forked child that inherited this handler dies the default way instead."""
    if os.getpid() != _MAIN_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    merge = argv[:1] == ["merge"]
    parser = build_merge_parser() if merge else build_parser()
    args = parser.parse_args(argv[1:] if merge or argv[:1] == ["build"] else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    global _MAIN_PID
    _MAIN_PID = os.getpid()
    previous = signal.signal(signal.SIGTERM, _terminate) if _main_thread() else None
    try:
        run_merge(args) if merge else run_build(args)
    except RedraftError as exc:
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; tables already written are kept, temporary files removed.",
              file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
