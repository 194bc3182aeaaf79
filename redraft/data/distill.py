"""Self-distillation: regenerate every assistant turn of a chat dataset with the target.

A drafter is accepted most often when it learned the *target's* replies, not another model's.
``redraft-distill-data`` keeps each conversation's system and user turns, and replaces each
assistant turn with the target's own reply to the conversation so far (its earlier replies
included), greedy or sampled. The output is ShareGPT-format JSONL, readable by every CLI as
``--data sharegpt:FILE.jsonl``::

    redraft-distill-data --target default --data default-chat --output checkpoints/distilled.jsonl \\
        --max-new-tokens 256 --batch-size 8 --limit 2000

Replies come from a :class:`~redraft.data.replies.ReplyGenerator` kept full by
:func:`distill_stream`: up to ``--batch-size`` prompts in flight, a finished reply's slot taken
by its conversation's next turn or a new conversation. The console script (``redraft.entry``)
injects redraft's own engine (continuous batching, ``redraft.infer.replies``); called from
Python with no generator, this module falls back to Hugging Face ``generate`` (one left-padded
batch per poll). Greedy replies are the same from both in float32 (in bfloat16 rounding flips
near-ties with the batch shape, whichever generator runs).

Records are appended (and flushed) as soon as their conversation is done; running the same
command again skips every id already in the file, so an interrupted run resumes where it stopped.

Every argument, the output path, the data spec (it must hold conversations) and the device are
checked before the model loads; an error is one line on stderr and exit status 2, Ctrl-C exit
status 130. This module imports no torch at import time (``--help`` is instant).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from pathlib import Path

from redraft.cli import ModelSettings, run_cli
from redraft.data.regenerate import (
    PROG,
    distill,
    distill_stream,
    first_ids,
    read_done_ids,
    split_chats,
)
from redraft.data.sources import parse_spec
from redraft.errors import ConfigError
from redraft.utils import ArgumentParser, HelpFormatter

# the command, and the distillation's names (redraft.data.regenerate) importable from here
__all__ = [
    "PROG",
    "build_parser",
    "check_args",
    "distill",
    "distill_stream",
    "first_ids",
    "main",
    "read_done_ids",
    "split_chats",
]

# Sources whose records are documents (code files), never conversations.
DOCUMENT_KINDS = ("default-code", "code-dir", "stack")


MODEL_FLAGS = (
    "target",
    "dtype",
    "device",
)  # the shared model flags it takes (redraft.cli.ModelSettings)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Regenerate every assistant turn of a chat dataset with the target model and write "
        "ShareGPT JSONL (resumable: ids already in --output are skipped).",
        formatter_class=HelpFormatter,
    )
    ModelSettings.add_arguments(p, only=MODEL_FLAGS)
    p.add_argument(
        "--data",
        default="default-chat",
        help="chat data spec, e.g. default-chat, "
        "sharegpt:FILE.jsonl, ultrachat:HuggingFaceH4/ultrachat_200k?split=train_sft",
    )
    p.add_argument("--output", required=True, help="output JSONL file; appended to when it exists")
    p.add_argument(
        "--max-new-tokens", type=int, default=256, help="longest reply in tokens (at least 1)"
    )
    p.add_argument(
        "--max-turns",
        type=int,
        default=None,
        help="reply to at most this many user turns per conversation (at least 1; default: all)",
    )
    p.add_argument(
        "--batch-size", type=int, default=8, help="conversations generated together (at least 1)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy, else the sampling temperature (a finite number >= 0)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling threshold when sampling, in (0, 1]",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="at most this many source conversations, done ones "
        "included (at least 1; default: all)",
    )
    p.add_argument(
        "--split",
        choices=["all", "train", "heldout"],
        default="all",
        help="which split of the source to distill",
    )
    p.add_argument(
        "--heldout-fraction", type=float, default=0.02, help="held-out share for --split, in (0, 1)"
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=2048,
        help="end a conversation before a turn whose prompt is longer",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.add_argument(
        "--speculate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="redraft's engine drafts with the context n-gram drafter where the speculation "
        "guard measures that it pays: the same replies (greedy; sampling keeps the target's "
        "distribution), faster at moderate batch sizes",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice; on a "
        "CPU busy with other work 1 thread can be several times faster)",
    )
    p.add_argument(
        "--sort-window",
        type=int,
        default=8,
        help="read this many batches ahead and sort them by "
        "prompt length to pad less; 1 keeps the source order",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show a progress bar",
    )
    return p


def check_args(args) -> None:
    """Every check that needs no model, so that a mistake costs no model load.

    Raises:
        ConfigError: naming the flag, its value and the valid range.
        DataError: a data spec that does not parse or names only document sources.
    """
    ModelSettings.from_args(args)  # the shared model flags: typed, checked, defaults set on args

    def bad(name: str, rule: str):
        value = getattr(args, name)
        return ConfigError(
            f"--{name.replace('_', '-')} {value} is out of range: {rule}.", param=name
        )

    if args.threads is not None and args.threads < 1:
        raise bad("threads", "it must be at least 1 (leave it out for torch's choice)")
    for name in ("max_new_tokens", "batch_size", "max_prompt_tokens", "sort_window"):
        if getattr(args, name) < 1:
            raise bad(name, "it must be at least 1")
    if args.max_turns is not None and args.max_turns < 1:
        raise bad("max_turns", "it must be at least 1 (leave it out to reply to every turn)")
    if args.limit is not None and args.limit < 1:
        raise bad("limit", "it must be at least 1 (leave it out to distill every conversation)")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise bad("temperature", "it must be a finite number >= 0 (0 = greedy)")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise bad("top_p", "it must be in (0, 1]")
    if not (math.isfinite(args.heldout_fraction) and 0 < args.heldout_fraction < 1):
        raise bad("heldout_fraction", "it must be in (0, 1)")
    components = parse_spec(args.data)  # DataError naming the spec
    if all(c.kind in DOCUMENT_KINDS for c in components):
        raise ConfigError(
            f"--data {args.data!r} holds documents (code files), not conversations: "
            f"distillation regenerates the assistant turns of chats. Pass a chat source "
            f"(default-chat, sharegpt:PATH, ultrachat:PATH_OR_ID).",
            param="data",
        )
    out = Path(args.output).expanduser()
    if out.is_dir():
        raise ConfigError(
            f"--output {out} is a directory; pass a .jsonl file path (created, or "
            f"appended to when it exists).",
            param="output",
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--output {out}: its folder cannot be created ({exc.strerror or exc}).", param="output"
        ) from exc
    if not os.access(out if out.exists() else out.parent, os.W_OK):
        raise ConfigError(
            f"--output {out} is not writable; pass a file you can write.", param="output"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # a time limit's SIGTERM ends it as Ctrl-C does: what was made is said, and kept
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        return run_cli(
            PROG,
            lambda: _run(args),
            interrupted="the conversations written so far are kept (run the same command "
            "again to resume).",
        )
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _run(args) -> int:
    check_args(args)
    from redraft.models import load_target
    from redraft.utils import resolve_device, resolve_dtype

    device = resolve_device(args.device)  # "cuda" without CUDA: one line, before the load
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, device) if args.dtype is not None else None
    target = load_target(args.target, dtype=dtype, device=device)
    result = distill(
        target,
        args.data,
        args.output,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        top_p=args.top_p,
        limit=args.limit,
        split=args.split,
        heldout_fraction=args.heldout_fraction,
        max_prompt_tokens=args.max_prompt_tokens,
        seed=args.seed,
        sort_window=args.sort_window,
        progress=args.progress,
        max_turns=args.max_turns,
        speculate=args.speculate,
    )
    print(
        f"wrote {result.get('written', 0)} conversations to {args.output} "
        f"({result.get('skipped_done', 0)} already there; {result.get('new_tokens', 0)} new tokens in "
        f"{result['seconds']} s with {result['generator']}); source: {result['source']}",
        file=sys.stderr,
    )
    if "engine" in result:
        print(f"engine: {result['engine']}", file=sys.stderr)
    ended = {k: v for k, v in result.items() if k in ENDED_EARLY}
    if ended:
        print(f"ended early or skipped: {ended}", file=sys.stderr)
    return 0


# the counts that say why a conversation ended early or was skipped
ENDED_EARLY = (
    "prompt_too_long",
    "empty_reply",
    "hit_max_new_tokens",
    "no_reply",
    "not_a_conversation",
)


if __name__ == "__main__":
    sys.exit(main())
