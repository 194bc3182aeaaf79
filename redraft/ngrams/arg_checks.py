"""``redraft-build-ngrams``' arguments checked, all of them before any work: the kinds, the
numbers' ranges, the model flags (and their defaults), the data spec, the output and spill
directories; and the spill folders of killed builds cleaned before a tri-gram build."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from redraft.cli import ModelSettings
from redraft.errors import ConfigError
from redraft.ngrams.format import KINDS, META_FILE

logger = logging.getLogger("redraft.ngrams")


# the shared model flags this command takes (redraft.cli.ModelSettings); the bigram forward
# computes in bfloat16 unless told otherwise (AMX / tensor cores)
MODEL_FLAGS = ("target", "dtype", "device", "threads")
MODEL_DEFAULTS = {"dtype": "bfloat16"}


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ConfigError(
            f"unknown n-gram kind(s) {bad or text!r} in --kinds; use a comma-separated "
            f"subset of {','.join(KINDS)}.",
            param="kinds",
        )
    return kinds


def _at_least(args, name: str, low: int, *, optional: bool = False, what: str = "") -> None:
    value = getattr(args, name)
    if optional and value is None:
        return
    if value < low:
        flag = "-" + name if len(name) == 1 else "--" + name.replace("_", "-")
        raise ConfigError(
            f"{flag} {value} is out of range: it must be at least {low}{what}.", param=name
        )


def check_output_dir(path, flag: str = "--output-dir", param: str = "output_dir") -> Path:
    """Create ``path`` as a directory (or accept an existing one) and check it is writable.

    Raises:
        ConfigError: ``path`` is a file, cannot be created, or is not writable.
    """
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"{flag} {path} is an existing file; pass a directory (it is created when missing).",
            param=param,
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{flag} {path} cannot be created ({exc.strerror or exc}); pass a "
            f"directory you can write to.",
            param=param,
        ) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{flag} {path} is not writable; pass a directory you can write to.", param=param
        )
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
    ModelSettings.from_args(args, MODEL_DEFAULTS)  # the model flags: typed and checked, set on args
    if not 0 <= args.shard_id < args.num_shards:
        raise ConfigError(
            f"--shard-id {args.shard_id} is not in 0..{args.num_shards - 1} "
            f"(--num-shards {args.num_shards}).",
            param="shard_id",
        )
    if args.num_shards > 1 and kinds != ["trigram"]:
        raise ConfigError(
            "--num-shards shards the tri-gram corpus only: pass --kinds trigram, and "
            "build the model tables in one unsharded run into the same --output-dir.",
            param="num_shards",
        )
    out = Path(args.output_dir).expanduser()
    if "extended" in kinds and "bigram" not in kinds and not _done(out, "bigram"):
        raise ConfigError(
            f"--kinds extended chains the bigram table: add bigram to --kinds (none in {out} yet).",
            param="kinds",
        )
    if "trigram" in kinds:
        from redraft.data.sources import parse_spec  # light: no torch

        parse_spec(args.data)  # DataError naming the spec
    check_output_dir(out)
    if args.spill_dir is not None:
        check_output_dir(args.spill_dir, "--spill-dir", "spill_dir")
    return kinds


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
