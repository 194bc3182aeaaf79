"""Regenerating a chat dataset's assistant turns with the target: conversations kept in flight
(a finished reply's slot taken by the next turn or a new conversation), each record appended as
soon as its conversation is done, and the ids already written skipped on a rerun. The command
and the guide are :mod:`redraft.data.distill`."""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from redraft.data.records import DataStats, Record, is_heldout, record_to_sharegpt
from redraft.data.replies import ReplyFactory, ReplyGenerator, ReplySettings, make_replies
from redraft.data.sources import iter_records
from redraft.errors import DataError

PROG = "redraft-distill-data"

logger = logging.getLogger("redraft.data.distill")  # the command's name, which its log lines carry


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
    import torch

    output = Path(output)
    existed, done = _done_so_far(output)
    torch.manual_seed(seed)
    stats = DataStats()
    counts: Counter = Counter()
    records = iter_records(spec, stats=stats)
    bar = _progress_bar(limit, progress)
    t0 = time.perf_counter()
    todo = _todo(records, split, heldout_fraction, limit, done, counts, bar)
    made_with = _made_with(target, temperature, top_p, max_new_tokens, max_turns)
    gen = _reply_generator(
        target, replies, max_new_tokens, temperature, top_p, seed, batch_size, speculate
    )
    bar.set_description(f"distilling ({gen.name})")
    prompt_limit = _prompt_limit(target, max_prompt_tokens, max_new_tokens)
    stream = _distilled(gen, target, todo, batch_size, sort_window, prompt_limit, counts, max_turns)
    try:
        _write_replies(output, stream, made_with, done, counts, bar, t0)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM at a time limit (the CLI): say what was made
        _interrupted(bar, counts, gen, t0)
        raise
    bar.close()
    if not counts["conversations_read"]:
        _no_conversation(spec, output, existed, counts, stats)
    return _result(counts, gen, stats, t0)


def _done_so_far(output: Path) -> tuple[bool, set[str]]:
    """Whether ``output`` existed, and the ids already in it (its folder created)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    existed = output.exists()
    return existed, read_done_ids(output)


def _progress_bar(limit: int | None, progress: bool):
    """The bar of conversations (``limit`` of them, when given)."""
    from tqdm.auto import tqdm

    return tqdm(
        total=limit, desc="distilling", unit=" conv", disable=not progress, dynamic_ncols=True
    )


def _todo(records, split: str, heldout_fraction: float, limit, done: set, counts, bar):
    """The first ``limit`` conversations of ``split``, less those already done (counted and
    ticked off on the bar)."""
    seen = 0
    for r in split_chats(records, split, heldout_fraction, counts):
        if limit is not None and seen >= limit:
            return
        seen += 1
        if r.id in done:
            counts["skipped_done"] += 1
            bar.update(1)
            continue
        yield r


def _made_with(target, temperature: float, top_p: float, max_new_tokens: int, max_turns) -> dict:
    """What every written record says it was made with (``distilled_with``)."""
    return {
        "target": target.model_id,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "max_turns": max_turns,
    }


def _reply_generator(
    target, replies, max_new_tokens, temperature, top_p, seed, batch_size, speculate
) -> ReplyGenerator:
    """The reply generator of ``replies`` (see :func:`~redraft.data.replies.make_replies`)."""
    return make_replies(
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


def _distilled(
    gen, target, todo, batch_size: int, sort_window: int, prompt_limit, counts, max_turns
):
    """Each conversation's distilled record (None: no reply) as it ends, the conversations read
    in length-sorted batches."""
    ordered = itertools.chain.from_iterable(_length_sorted_batches(todo, batch_size, sort_window))
    return distill_stream(
        gen,
        target.tokenizer,
        ordered,
        capacity=batch_size,
        max_prompt_tokens=prompt_limit,
        counts=counts,
        max_turns=max_turns,
    )


def _write_replies(output: Path, stream, made_with: dict, done: set, counts, bar, t0) -> None:
    """Append each distilled record of ``stream`` to ``output`` as it comes; the bar ticks for
    every conversation, with the new tokens per second."""
    with open(output, "a", encoding="utf-8") as f:
        for r in stream:
            if r is not None:
                _write_reply(f, r, made_with)
                done.add(r.id)
                counts["written"] += 1
            bar.update(1)
            rate = counts["new_tokens"] / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"{rate:,.1f} tok/s", refresh=False)


def _interrupted(bar, counts, gen, t0: float) -> None:
    """Close the bar and say what a stopped run made."""
    bar.close()
    logger.warning(
        "interrupted after %d conversations written (%d new tokens in %.1f s)%s",
        counts["written"],
        counts["new_tokens"],
        time.perf_counter() - t0,
        f"; engine: {gen.stats()}" if hasattr(gen, "stats") else "",
    )


def _result(counts, gen, stats, t0: float) -> dict:
    """The counts, the time, the generator (and its engine's stats) and the source's summary."""
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
