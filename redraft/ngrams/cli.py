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
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from redraft.cli import ModelSettings, run_cli
from redraft.errors import ConfigError
from redraft.ngrams.arg_checks import (
    MODEL_DEFAULTS,
    MODEL_FLAGS,
    _at_least,
    _clean_spills,
    _done,
    check_build_args,
    check_output_dir,
)
from redraft.ngrams.build import (  # noqa: F401  (shard_dir: re-exported)
    TableWriter,
    build_bigram,
    build_extended,
    build_trigram,
    build_unigram,
    load_build_target,
    shard_dir,
)
from redraft.ngrams.format import KINDS, SHARD_GLOB, SHARDS_SUFFIX
from redraft.utils import ArgumentParser, HelpFormatter

logger = logging.getLogger("redraft.ngrams")
PROG = "redraft-build-ngrams"


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
        formatter_class=HelpFormatter,
    )
    ModelSettings.add_arguments(p, only=MODEL_FLAGS, shown=MODEL_DEFAULTS)
    p.add_argument(
        "--kinds",
        default="unigram,bigram,extended,trigram",
        help=f"comma-separated tables to build, from {','.join(KINDS)}",
    )
    p.add_argument(
        "--data",
        default="default-chat",
        help="corpus for the tri-gram table, a redraft.data spec: default-chat, "
        "default-code, sharegpt:PATH, code-dir:DIR?glob=*.py, hub datasets, mixtures",
    )
    p.add_argument(
        "--split",
        default="train",
        choices=["train", "heldout", "all"],
        help="which records of --data to count (heldout = the evaluation prompts)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="use at most this many records of --data (at least 1; default: all)",
    )
    p.add_argument(
        "--output-dir",
        required=True,
        help="artifact directory (created; other kinds already in it are kept)",
    )
    p.add_argument(
        "-k",
        type=int,
        default=25,
        help="successors per token in the unigram/bigram tables (1..vocabulary size)",
    )
    p.add_argument("-w", type=int, default=10, help="tokens per extended-bigram chain (at least 1)")
    p.add_argument(
        "-t", type=int, default=12, help="successors kept per tri-gram context (1..vocabulary size)"
    )
    p.add_argument(
        "--min-count",
        type=int,
        default=2,
        help="drop tri-grams seen fewer times (1 keeps all; 2 halves the table)",
    )
    p.add_argument(
        "--extend-with-model",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="chain extended rows by greedy decoding with the target instead of the "
        "bigram table (vocab*k generations: for GPUs)",
    )
    p.add_argument("--batch-size", type=int, default=1024, help="tokens per bigram forward")
    p.add_argument(
        "--num-shards",
        type=int,
        default=1,
        help="split the tri-gram corpus into this many shards (records i with "
        "i %% N == shard-id); each shard writes partial counts, `merge` finishes",
    )
    p.add_argument("--shard-id", type=int, default=0, help="this job's shard, 0..num-shards-1")
    p.add_argument(
        "--memory-mb",
        type=int,
        default=4096,
        help="memory budget for tri-gram counts; beyond it sorted runs spill to disk",
    )
    p.add_argument(
        "--spill-dir",
        default=None,
        help="where tri-gram counts beyond --memory-mb go, in a private folder removed "
        "at the end (default: --output-dir; a killed build's leftovers are removed "
        "by the next build into the same place)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=1 << 25,
        help="tokens sorted at a time (about 24 bytes of memory each)",
    )
    p.add_argument(
        "--num-proc",
        type=int,
        default=None,
        help="tokenizer processes (default: one per CPU, at most 8)",
    )
    p.add_argument(
        "--overwrite",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="rebuild kinds already present in --output-dir (default: skip them)",
    )
    p.add_argument(
        "--quiet", action=argparse.BooleanOptionalAction, default=False, help="no progress bars"
    )
    return p


def build_merge_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=f"{PROG} merge",
        description="Combine the partial tri-gram counts of `--num-shards N` jobs into the "
        "tri-gram table of --output-dir (equal to a single unsharded build). The "
        "shards' checksums are checked first. Afterwards the shard directories "
        "inside --output-dir move to OUTPUT_DIR.shards/ (the artifact directory then "
        "holds one artifact; a later merge finds them there).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--output-dir", required=True, help="artifact directory to write the table into")
    p.add_argument(
        "--shards",
        nargs="*",
        default=None,
        help="shard count directories (default: OUTPUT_DIR/trigram-counts-*-of-*, "
        "then OUTPUT_DIR.shards/ for a re-merge)",
    )
    p.add_argument("-t", type=int, default=12, help="successors kept per context")
    p.add_argument("--min-count", type=int, default=2, help="drop tri-grams seen fewer times")
    p.add_argument("--memory-mb", type=int, default=4096, help="memory budget of the range merge")
    p.add_argument(
        "--keep-shards",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the shard counts (moved to OUTPUT_DIR.shards/) for a later re-merge "
        "with other -t/--min-count; --no-keep-shards deletes them after the merge",
    )
    p.add_argument(
        "--quiet", action=argparse.BooleanOptionalAction, default=False, help="no progress bars"
    )
    return p


# ------------------------------------------------------------------------------------------
# build


def run_build(args) -> dict:
    """Build the requested kinds; returns the ``ngrams.json`` fields written (for a shard of a
    sharded tri-gram build: its count directory and corpus stats)."""
    kinds = check_build_args(args)
    out = Path(args.output_dir).expanduser()
    todo = [k for k in kinds if args.overwrite or args.num_shards > 1 or not _done(out, k)]
    for k in kinds:
        if k not in todo:
            logger.warning("%s: %s table exists, skipped (pass --overwrite to rebuild it)", out, k)
    if not todo:
        return {}
    if "trigram" in todo:
        _clean_spills(out, args.spill_dir)
    target = load_build_target(args)
    save = TableWriter(args, out, target)
    bigram_ids = None
    if "unigram" in todo:
        build_unigram(args, target, save)
    if "bigram" in todo:
        bigram_ids = build_bigram(args, target, save)
    if "extended" in todo:
        build_extended(args, target, out, bigram_ids, save)
    if "trigram" in todo:
        shard = build_trigram(args, target, out, save)
        if shard is not None:
            logger.warning(
                "shard %d/%d: %s tokens counted in %.1f s → %s; run `%s merge --output-dir %s` "
                "when all shards are done",
                args.shard_id,
                args.num_shards,
                f"{shard['stats']['tokens']:,}",
                shard.pop("count_seconds"),
                shard["shard_dir"],
                PROG,
                out,
            )
            return shard
    return save.written


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
    logger.warning(
        "%s %d shard directories out of the artifact %s%s",
        "moved" if keep else "deleted",
        len(inside),
        out,
        f" to {home}" if keep else "",
    )


def run_merge(args) -> dict:
    """Merge shard counts in ``args.output_dir`` (or ``args.shards``) into its tri-gram table."""
    out, shards = _merge_inputs(args)

    from redraft.ngrams.tables import save_tables
    from redraft.ngrams.trigram_runs import open_run
    from redraft.ngrams.trigrams import build_trigram_table, load_counts

    t0 = time.perf_counter()
    counts = load_counts(shards, memory_mb=args.memory_mb)  # checksums, completeness, agreement
    first = open_run(shards[0])[2]
    table = build_trigram_table(counts, t=args.t, min_count=args.min_count, progress=not args.quiet)
    seconds = time.perf_counter() - t0
    meta = _merged_meta(args, shards, first, counts, table, seconds)
    save_tables(out, meta, trigram=table)
    # Only now, with the table and ngrams.json written: a kill before this leaves the shards
    # where a rerun of the merge finds them.
    _move_shards_out(shards, out, keep=args.keep_shards)
    logger.warning(
        "merged %d shards: %s contexts, %s entries in %.1f s → %s",
        len(shards),
        f"{table.stats['contexts']:,}",
        f"{table.stats['entries']:,}",
        seconds,
        out,
    )
    return meta


def _merge_inputs(args) -> tuple[Path, list[Path]]:
    """The checked output folder (its old spills removed) and the shards to merge."""
    for name in ("t", "min_count"):
        _at_least(args, name, 1)
    _at_least(args, "memory_mb", 0)
    out = Path(args.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"--output-dir {out} is an existing file; pass the directory the shards "
            f"were written to.",
            param="output_dir",
        )
    shards = [Path(s).expanduser() for s in args.shards] if args.shards else find_shards(out)
    if not shards:
        raise ConfigError(
            f"no shard counts found in {out} ({SHARD_GLOB}) or {shards_home(out)}; "
            f"run the shards with --num-shards N --shard-id i --output-dir {out} "
            f"first, or pass --shards.",
            param="shards",
        )
    check_output_dir(out)
    _clean_spills(out)
    return out, shards


def _merged_meta(args, shards: list[Path], first: dict, counts, table, seconds: float) -> dict:
    """The merged table's ngrams.json: the target's fields from the first shard, the build's."""
    from redraft.ngrams.trigram_runs import open_run

    target_fields = {
        k: first[k]
        for k in (
            "target_model",
            "target_vocab_size",
            "target_hidden_size",
            "tokenizer_fingerprint",
        )
        if k in first
    }
    shard_args = dict(
        first.get("build_args") or {k: first.get(k) for k in ("data", "split", "limit")}
    )
    shard_args.update(
        t=args.t,
        min_count=args.min_count,
        memory_mb=args.memory_mb,
        num_shards=first.get("num_shards", len(shards)),
    )
    return dict(
        target_fields,
        vocab_size=counts.vocab_size,
        t=args.t,
        build_seconds={"trigram_merge": round(seconds, 2)},
        build_args={"trigram": shard_args},
        trigram={
            "t": args.t,
            "min_count": args.min_count,
            "data": first.get("data"),
            "split": first.get("split"),
            "corpus": table.stats,
            "shards": len(shards),
            "table_bytes": table.nbytes(),
            "count_seconds_per_shard": [open_run(s)[2].get("count_seconds") for s in shards],
        },
    )


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

    def work() -> None:
        previous = signal.signal(signal.SIGTERM, _terminate) if _main_thread() else None
        try:
            run_merge(args) if merge else run_build(args)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    return run_cli(
        PROG, work, interrupted="tables already written are kept, temporary files removed."
    )


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
