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
import itertools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from redraft.cli import ModelSettings, run_cli
from redraft.data.records import DataStats, Record, is_heldout, record_to_sharegpt
from redraft.data.replies import ReplyFactory, ReplyGenerator, ReplySettings, make_replies
from redraft.data.sources import iter_records, parse_spec
from redraft.errors import ConfigError, DataError
from redraft.utils import ArgumentParser, HelpFormatter

PROG = "redraft-distill-data"
# Sources whose records are documents (code files), never conversations.
DOCUMENT_KINDS = ("default-code", "code-dir", "stack")

logger = logging.getLogger(__name__)


def read_done_ids(path: Path) -> set[str]:
    """Ids already written to ``path``. A last line cut by a crash is removed from the file."""
    done: set[str] = set()
    if not path.exists():
        return done
    good_end = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break  # cut mid-write: drop it below
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise DataError(
                    f"{path} line {lineno} is not JSON ({exc}); it is not an output of "
                    f"{PROG}. Pass a new --output file."
                ) from exc
            if not isinstance(obj, dict) or "id" not in obj:
                raise DataError(
                    f"{path} line {lineno} is a JSON value without an 'id'; it is not an "
                    f"output of {PROG}. Pass a new --output file."
                )
            done.add(str(obj["id"]))
            good_end += len(line)
    if good_end < path.stat().st_size:
        logger.warning(
            "%s ends with an incomplete line (an interrupted run); removing it and resuming", path
        )
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return done


def _prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


@dataclass
class _Conversation:
    """One conversation being distilled: its system turn and the replies so far, the user
    turns still to answer, and whether it goes on."""

    record: Record
    messages: list[dict]
    users: list[str]
    turn: int = 0

    @classmethod
    def of(cls, r: Record, max_turns: int | None) -> _Conversation:
        head = [dict(m) for m in r.messages[:1] if m["role"] == "system"]
        users = [m["content"] for m in r.messages if m["role"] == "user"][:max_turns]
        return cls(r, head, users)

    def next_prompt(self, tok, max_prompt_tokens: int, counts) -> list[int] | None:
        """The next turn's prompt ids, or None: no turn left, or (counted) its prompt is longer
        than ``max_prompt_tokens``."""
        if self.turn >= len(self.users):
            return None
        ids = _prompt_ids(tok, self.messages + [{"role": "user", "content": self.users[self.turn]}])
        if len(ids) > max_prompt_tokens:
            counts["prompt_too_long"] += 1
            return None
        return ids

    def take(self, tok, reply: list[int], stopped: bool, counts) -> bool:
        """Add the reply to the current turn; whether the conversation goes on (an empty reply
        ends it unanswered, a reply cut by max_new_tokens ends it after this turn)."""
        counts["new_tokens"] += len(reply)
        text = tok.decode(reply, skip_special_tokens=True)
        if not text.strip():
            counts["empty_reply"] += 1
            return False
        self.messages += [
            {"role": "user", "content": self.users[self.turn]},
            {"role": "assistant", "content": text},
        ]
        self.turn += 1
        if not stopped:
            counts["hit_max_new_tokens"] += 1
            return False
        return True

    def result(self, counts) -> Record | None:
        """The distilled record, or None (counted) when no turn got a reply."""
        if not any(m["role"] == "assistant" for m in self.messages):
            counts["no_reply"] += 1
            return None
        r = self.record
        return Record(id=r.id, kind="chat", messages=self.messages, source=r.source)


def distill_stream(
    gen: ReplyGenerator,
    tok,
    records: Iterable[Record],
    *,
    capacity: int,
    max_prompt_tokens: int,
    counts,
    max_turns: int | None = None,
) -> Iterator[Record | None]:
    """Regenerate the assistant turns of ``records`` with ``gen``, turn by turn, keeping up to
    ``capacity`` prompts in flight: each finished reply frees a slot for its conversation's
    next turn (first) or a new conversation. Yields each conversation's distilled record
    (None when it got no reply) as it ends, in the order they end.

    A conversation ends when its next prompt would exceed ``max_prompt_tokens``, a reply is
    empty, a reply ran into the generator's ``max_new_tokens``, or its (first ``max_turns``)
    user turns are all answered. One with no reply at all yields None.
    """
    source = iter(records)
    ready: deque[_Conversation] = deque()  # conversations whose next turn is to be submitted
    flying: dict[int, _Conversation] = {}  # key -> conversation whose reply is being made
    keys = itertools.count()
    while True:
        while len(flying) < capacity:
            if ready:
                conv = ready.popleft()
            elif (r := next(source, None)) is not None:
                conv = _Conversation.of(r, max_turns)
            else:
                break
            prompt = conv.next_prompt(tok, max_prompt_tokens, counts)
            if prompt is None:
                yield conv.result(counts)
                continue
            key = next(keys)
            flying[key] = conv
            gen.submit(key, prompt)
        if not flying:
            return
        finished = gen.poll()
        if not finished:
            raise RuntimeError(f"{gen.name}.poll() returned nothing with {len(flying)} in flight")
        for key, reply, stopped in finished:
            conv = flying.pop(key)
            if conv.take(tok, reply, stopped, counts):
                ready.append(conv)
            else:
                yield conv.result(counts)


def split_chats(
    records: Iterable[Record], split: str, heldout_fraction: float, counts=None
) -> Iterator[Record]:
    """The conversations of ``split`` (``all``, ``train``, ``heldout``) among ``records``, in source
    order: what :func:`distill` reads, its ``limit`` counting them (the ``counts``, when given,
    of documents skipped and conversations read)."""
    for r in records:
        if r.kind != "chat":
            if counts is not None:
                counts["not_a_conversation"] += 1
            continue
        if counts is not None:
            counts["conversations_read"] += 1
        if split != "all" and is_heldout(r.id, heldout_fraction) != (split == "heldout"):
            continue
        yield r


def first_ids(spec: str, split: str, heldout_fraction: float, limit: int) -> set[str]:
    """Ids of the first ``limit`` conversations of ``split`` in ``spec``: those a :func:`distill`
    call with this ``limit`` replies to (reads the source, loads no model)."""
    return {
        r.id
        for r in itertools.islice(split_chats(iter_records(spec), split, heldout_fraction), limit)
    }


def _prompt_limit(target, max_prompt_tokens: int, max_new_tokens: int) -> int:
    """The longest prompt a turn may have: ``max_prompt_tokens``, and room for the reply within
    the model's context (when it has a known one)."""
    context = getattr(target.model.config, "max_position_embeddings", None)
    if not context:
        return max_prompt_tokens
    return min(max_prompt_tokens, context - max_new_tokens)


def _length_sorted_batches(records, batch_size: int, window: int):
    """Batches of ``batch_size`` from windows of ``window`` batches sorted by prompt length
    (characters of the user turns), so that a batch pads little; output order follows the batches."""
    while True:
        pool = [r for _, r in zip(range(batch_size * max(window, 1)), records)]
        if not pool:
            return
        if window > 1:
            pool.sort(
                key=lambda r: sum(len(m["content"]) for m in r.messages if m["role"] != "assistant")
            )
        for i in range(0, len(pool), batch_size):
            yield pool[i : i + batch_size]


def distill(
    target,
    spec: str,
    output,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    temperature: float = 0.0,
    top_p: float = 1.0,
    limit: int | None = None,
    split: str = "all",
    heldout_fraction: float = 0.02,
    max_prompt_tokens: int = 2048,
    seed: int = 0,
    sort_window: int = 8,
    progress: bool = True,
    max_turns: int | None = None,
    replies: ReplyFactory | None = None,
    speculate: bool = True,
) -> dict:
    """Write the target's own replies for the chats of ``spec`` to ``output`` (ShareGPT JSONL).

    Args:
        target: a :class:`redraft.models.Target`.
        spec: a chat data spec, e.g. ``"default-chat"``.
        output: the JSONL file; created, or appended to (ids already in it are skipped).
        max_new_tokens: longest reply; a reply that hits it ends its conversation.
        batch_size: replies generated together (prompts in flight at most).
        temperature: 0 = greedy; otherwise sampling with ``top_p``.
        limit: at most this many source conversations (counting those already done).
        split: ``"all"``, ``"train"`` or ``"heldout"`` records of the source.
        max_prompt_tokens: a conversation ends before a turn whose prompt is longer (or whose
            reply could run past the model's context).
        seed: torch seed for sampling (the engine seeds each request from it).
        sort_window: batches read ahead and sorted by prompt length (less padding); 1 keeps the
            source order.
        speculate: redraft's engine drafts with the context n-gram drafter where it pays (the
            same replies, faster at moderate batch sizes; ``ReplySettings.speculate``).
        progress: show a progress bar (conversations, and new tokens per second).
        max_turns: reply to at most this many user turns per conversation (None: all).
        replies: the :class:`~redraft.data.replies.ReplyGenerator` factory; None: the one
            :func:`~redraft.data.replies.use_replies` set (the console scripts: redraft's
            engine), else Hugging Face ``generate``.

    Returns:
        Counts: written, skipped_done, new_tokens, seconds and why conversations ended early.
    """
    from collections import Counter

    import torch
    from tqdm.auto import tqdm

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    existed = output.exists()
    done = read_done_ids(output)
    torch.manual_seed(seed)
    stats = DataStats()
    counts: Counter = Counter()
    records = iter_records(spec, stats=stats)
    bar = tqdm(
        total=limit, desc="distilling", unit=" conv", disable=not progress, dynamic_ncols=True
    )
    t0 = time.perf_counter()
    seen = 0

    def todo():
        nonlocal seen
        for r in split_chats(records, split, heldout_fraction, counts):
            if limit is not None and seen >= limit:
                return
            seen += 1
            if r.id in done:
                counts["skipped_done"] += 1
                bar.update(1)
                continue
            yield r

    made_with = {
        "target": target.model_id,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "max_turns": max_turns,
    }
    gen = make_replies(
        target,
        ReplySettings(
            max_new_tokens=max_new_tokens,
            stop_ids=tuple(target.eos_token_ids),
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            batch_size=batch_size,
            speculate=speculate,
        ),
        replies,
    )
    bar.set_description(f"distilling ({gen.name})")
    ordered = itertools.chain.from_iterable(_length_sorted_batches(todo(), batch_size, sort_window))
    try:
        with open(output, "a", encoding="utf-8") as f:
            for r in distill_stream(
                gen,
                target.tokenizer,
                ordered,
                capacity=batch_size,
                max_prompt_tokens=_prompt_limit(target, max_prompt_tokens, max_new_tokens),
                counts=counts,
                max_turns=max_turns,
            ):
                if r is not None:
                    _write_reply(f, r, made_with)
                    done.add(r.id)
                    counts["written"] += 1
                bar.update(1)
                rate = counts["new_tokens"] / max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix_str(f"{rate:,.1f} tok/s", refresh=False)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM at a time limit (the CLI): say what was made
        bar.close()
        logger.warning(
            "interrupted after %d conversations written (%d new tokens in %.1f s)%s",
            counts["written"],
            counts["new_tokens"],
            time.perf_counter() - t0,
            f"; engine: {gen.stats()}" if hasattr(gen, "stats") else "",
        )
        raise
    bar.close()
    if not counts["conversations_read"]:
        _no_conversation(spec, output, existed, counts, stats)
    counts["seconds"] = round(time.perf_counter() - t0, 2)
    counts["generator"] = gen.name
    result = dict(counts)
    if hasattr(gen, "stats"):  # redraft's engine: where its time went
        result["engine"] = gen.stats()
    result["source"] = stats.summary()
    return result


def _write_reply(f, r, made_with: dict) -> None:
    """One distilled conversation as a ShareGPT JSONL line, flushed (a stopped run keeps it)."""
    obj = record_to_sharegpt(r)
    obj["source"] = r.source
    obj["distilled_with"] = made_with
    f.write(json.dumps(obj, ensure_ascii=False) + "\n")
    f.flush()


def _no_conversation(spec: str, output: Path, existed: bool, counts, stats) -> None:
    """The source held no chat: leave no empty file behind and say what to pass."""
    if not existed and output.stat().st_size == 0:
        output.unlink()
    raise DataError(
        f"data spec {spec!r} holds no conversation to distill "
        f"({counts['not_a_conversation']} document records; source: {stats.summary()}): "
        f"distillation regenerates the assistant turns of chats. Pass a chat source "
        f"(default-chat, sharegpt:PATH, ultrachat:PATH_OR_ID)."
    )


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
