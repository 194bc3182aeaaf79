"""``redraft-train`` and ``redraft-cache-features``.

    redraft-train                                      # the default recipe (SmolLM2-135M, ShareGPT)
    redraft-train --recipe tiny --target DIR --data sharegpt:FILE.jsonl --max-steps 20
    redraft-train --recipe default --lr 3e-4 --set num_layers=3 --output-dir checkpoints/mine
    redraft-train --output-dir checkpoints/mine --resume
    deepspeed --num_gpus 8 --module redraft.train.cli --recipe vicuna-7b-8xh100
    torchrun --nproc_per_node 8 -m redraft.train.cli --recipe vicuna-7b-8xh100

    redraft-cache-features --recipe default --output-dir checkpoints/features-smollm2
    redraft-train --recipe default --features checkpoints/features-smollm2

Every recipe key is also a flag (``--max-time-minutes 10``, ``--no-rnn``); ``--set KEY=VALUE``
works for any key. This module imports no torch until the arguments are parsed, so ``--help``
is instant. Errors are one line on stderr and exit status 2 (130 after Ctrl-C).
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys
from pathlib import Path

from redraft.cli import run_cli
from redraft.errors import ConfigError, RedraftError
from redraft.train.config import (
    DEFAULT_TOP_K,
    HIDDEN_DTYPES,
    TrainConfig,
    load_recipe,
    make_config,
    parse_set,
    recipe_names,
)
from redraft.utils import ArgumentParser, require_extra

DEFAULT_RECIPE = "default"
# the settings redraft-cache-features takes (which records, which target, where it runs)
CACHE_KEYS = (
    "target",
    "data",
    "max_length",
    "pack",
    "heldout_fraction",
    "train_limit",
    "num_proc",
    "data_cache_dir",
    "device",
    "precision",
    "threads",
    "distill_dir",
    "head_features",
    "feature_layers",
)


def add_config_arguments(p: argparse.ArgumentParser, keys=None, title: str = "settings") -> None:
    """One flag per TrainConfig key (``keys``: a subset), generated from its schema. Flags default
    to None, so only what the user typed overrides the recipe; the help shows the value the
    default recipe gives."""
    try:
        recipe = load_recipe(DEFAULT_RECIPE)
    except RedraftError:  # no recipes folder (a broken install): show the built-in defaults
        recipe = {}
    TrainConfig.add_arguments(
        p,
        title,
        f"each overrides --recipe; the defaults shown are those of the {DEFAULT_RECIPE!r} recipe",
        only=keys,
        shown=recipe,
    )


def _add_recipe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--recipe",
        default=DEFAULT_RECIPE,
        help=f"Recipe: one of {', '.join(recipe_names())} (train/recipes/), or a YAML file; 'none' for "
        f"the built-in defaults only. (default: {DEFAULT_RECIPE})",
    )
    p.add_argument(
        "--set",
        dest="set_",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override any recipe key (repeatable).",
    )


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="redraft-train",
        description="Train a ReDrafter draft head on a frozen target model (DeepSpeed; one process, "
        "or launch with `deepspeed`/`torchrun`). Settings: dataclass defaults <- --recipe "
        "<- flags / --set.",
    )
    _add_recipe_arguments(p)
    p.add_argument(
        "--resume",
        action="store_true",
        help="Continue the run in --output-dir from its newest checkpoint (weights, optimizer, "
        "schedule, data position, RNG); refused if settings or the target differ.",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="Replace a run already in --output-dir."
    )
    p.add_argument(
        "--print-config", action="store_true", help="Print the resolved config and exit."
    )
    p.add_argument(
        "--eval-only",
        action="store_true",
        help="Only evaluate the artifact given by --init-from on the held-out data (prints "
        "per-position accuracy and tau_est as JSON); trains and writes nothing.",
    )
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    add_config_arguments(p, title="recipe keys")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults <- ``--recipe`` <- ``--set`` <- flags, validated."""
    overrides = {**parse_set(args.set_), **TrainConfig.given(args)}
    recipe = None if args.recipe in (None, "", "none") else args.recipe
    return make_config(recipe, overrides)


def check_writable(path, flag: str) -> None:
    """Refuse, before any work, a directory a run cannot write: one under a file, or on a
    read-only or not-writable path (the first part of it that exists decides)."""
    p = Path(path).expanduser()
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                what = "is a file" if q == p else f"is under {q}, which is a file"
                raise ConfigError(
                    f"{flag} {p} {what}; pass a directory (it is created if missing).",
                    param=flag.lstrip("-"),
                )
            if not os.access(q, os.W_OK | os.X_OK):  # EROFS counts even for root
                raise ConfigError(
                    f"{flag} {p}: {q} is not writable (a read-only file system or no permission); "
                    f"choose another {flag}.",
                    param=flag.lstrip("-"),
                )
            return


def check_run_dir(out: Path, resume: bool, overwrite: bool) -> None:
    """``--resume`` needs something to resume; files of a run that never saved anything (a
    start that failed: ``run_config.yaml`` and the like) never block the next try."""
    from redraft.train import checkpoint as ckpt

    saved = (
        bool(ckpt.checkpoint_tags(out))
        or (out / "model.safetensors").is_file()
        or (out / ckpt.STAGE_DIR / ckpt.STAGE_DONE).exists()
    )
    if resume and not saved:
        raise ConfigError(
            f"--resume: {out} holds no checkpoint to resume ({ckpt.STATE_DIR}/step-N) and no "
            f"trained head; drop --resume to start a new run there.",
            param="resume",
        )
    leftovers = [name for name in ckpt.RUN_FILES if (out / name).exists()]
    if not saved and not resume and leftovers and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"redraft-train: {out} holds what a run that saved nothing left ({', '.join(leftovers)}); "
            f"replacing it.",
            file=sys.stderr,
        )
        for name in leftovers:
            q = out / name
            shutil.rmtree(q, ignore_errors=True) if q.is_dir() else q.unlink(missing_ok=True)


# what a write to a path the user chose can fail with: one line naming the path, not a traceback
WRITE_ERRORS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR)


def _run(prog: str, fn) -> int:
    """``run_cli`` over ``fn()`` (a RedraftError: one line, exit 2; Ctrl-C: exit 130), where a
    write that fails for want of space or permission is one line naming the path too."""

    def work() -> int:
        try:
            return fn()
        except OSError as exc:
            if exc.errno not in WRITE_ERRORS:
                raise
            raise ConfigError(
                f"cannot write {exc.filename or 'a file'}: {exc.strerror}; choose a writable "
                f"directory (--output-dir, --data-cache-dir)."
            ) from exc

    return run_cli(prog, work)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def go() -> int:
        cfg = config_from_args(args)
        if args.print_config:
            import yaml

            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
            return 0
        if args.eval_only:
            import json

            from redraft.train.trainer import evaluate_artifact

            print(json.dumps(evaluate_artifact(cfg), indent=2))
            return 0
        check_writable(cfg.resolved_output_dir(), "--output-dir")
        if cfg.data_cache_dir:
            check_writable(cfg.data_cache_dir, "--data-cache-dir")
        check_run_dir(cfg.resolved_output_dir(), args.resume, args.overwrite)
        require_extra("train", "deepspeed", "datasets", what="redraft-train")
        from redraft.train.trainer import train

        metrics = train(cfg, resume=args.resume, overwrite=args.overwrite)
        return 130 if metrics.get("status") == "interrupted" else 0

    return _run("redraft-train", go)


def build_cache_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="redraft-cache-features",
        description="Run the frozen target once over the training records and cache, per token, its last hidden "
        "state and top-k next-token logits, for `redraft-train --features DIR` (no target forward "
        "while training). Resumable: run it again with the same arguments after an interruption.",
    )
    _add_recipe_arguments(p)
    p.add_argument("--output-dir", required=True, metavar="DIR", help="The features directory.")
    p.add_argument(
        "--top-k",
        type=int,
        default=DEFAULT_TOP_K,
        metavar="K",
        help=f"Next-token logits kept per token, for the KD losses. (default: {DEFAULT_TOP_K})",
    )
    p.add_argument(
        "--hidden-dtype",
        choices=HIDDEN_DTYPES,
        default="bfloat16",
        help="dtype of the stored hidden states. (default: bfloat16)",
    )
    p.add_argument(
        "--batch-tokens",
        type=int,
        default=8192,
        metavar="N",
        help="Padded tokens per target forward. (default: 8192)",
    )
    p.add_argument(
        "--shard-mb",
        type=float,
        default=512,
        metavar="MB",
        help="About this many MiB per shard file (built in memory, then written). (default: 512)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="Replace features cached with other settings."
    )
    add_config_arguments(p, keys=CACHE_KEYS, title="which records and target (as in redraft-train)")
    return p


def cache_features_main(argv: list[str] | None = None) -> int:
    args = build_cache_parser().parse_args(argv)

    def go() -> int:
        cfg = config_from_args(args)
        check_writable(args.output_dir, "--output-dir")
        if cfg.data_cache_dir:
            check_writable(cfg.data_cache_dir, "--data-cache-dir")
        require_extra("train", "datasets", what="redraft-cache-features")
        from redraft.train.features import cache_features, disk_bytes

        meta = cache_features(
            cfg,
            args.output_dir,
            top_k=args.top_k,
            hidden_dtype=args.hidden_dtype,
            batch_tokens=args.batch_tokens,
            shard_mb=args.shard_mb,
            overwrite=args.overwrite,
        )
        size = disk_bytes(args.output_dir)
        print(
            f"redraft-cache-features: {meta['records']} records, {meta['tokens']} tokens in "
            f"{len(meta['shards'])} shard(s), {size / 2**20:.1f} MiB ({size / max(1, meta['tokens']):.0f} "
            f"bytes/token) in {args.output_dir}\n"
            f"train on them with: redraft-train --recipe {args.recipe} --features {args.output_dir} "
            f"(and the same data settings)",
            file=sys.stderr,
        )
        return 0

    return _run("redraft-cache-features", go)


if __name__ == "__main__":
    sys.exit(main())
