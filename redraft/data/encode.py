"""Records → token ids and assistant-only loss masks: rendering, tokenizing, masking, and the
worker pool that runs them over chunks of records (:mod:`redraft.data.tokens` caches the result).

How the loss mask is derived (any chat template, no string search)
------------------------------------------------------------------
For a conversation ``m[0..n)`` the template renders the full text ``T = render(m)``. For each
assistant turn ``k`` it also renders two growing prefixes::

    before_k  = render(m[:k],   add_generation_prompt=True)    # ... "<|im_start|>assistant\\n"
    through_k = render(m[:k+1], add_generation_prompt=False)   # ... "<|im_start|>assistant\\nHi!<|im_end|>\\n"

``through_k`` must be a prefix of ``T`` (a template whose earlier turns render differently once
later turns exist is reported as ``template_not_prefix``), so the characters
``[len(before_k), len(through_k))`` of ``T`` are exactly what the template writes for the
assistant's reply — its content and its end-of-turn marker — and nothing of the header. ``T``
is tokenized once with the fast tokenizer (batched); the characters map to tokens with
``Encoding.char_to_token``, a token that straddles the boundary counts as assistant, and
tokens after the span's last end-of-turn token (ChatML's ``"\\n"`` after ``<|im_end|>``) are
dropped from the mask: the model never generates them. Worked example (ChatML)::

    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n
    mask:  0 ...                                 0   1     1    1      0

Documents: every token counts; a document longer than ``max_length`` becomes several rows.

Rendering is Python (jinja), tokenizing is Rust; both run in ``num_proc`` worker processes
over chunks of records (:func:`map_chunks`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from redraft.data.records import DataStats, Record, Skip
from redraft.errors import DataError

# Tokens that end a turn in common templates; only used to trim the span's tail (see above).
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<end_of_turn>",
    "<|end|>",
    "</s>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|return|>",
)


# ---------------------------------------------------------------------------------------------
# rendering


class ChatRenderer:
    """A tokenizer's chat template, compiled once, rendering messages to text and assistant spans.

    Renders exactly what ``tokenizer.apply_chat_template(messages, tokenize=False)`` renders (the
    same compiled sandboxed template and the same variables), without its per-call overhead.
    """

    def __init__(self, tokenizer):
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise DataError(
                f"The tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template, so "
                f"chat data cannot be rendered. Use a chat model or document data (stack:, code-dir:)."
            )
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()))
        self.tokenizer = tokenizer
        self.template_text = template
        self._compiled = None
        self.variables = dict(getattr(tokenizer, "special_tokens_map", {}) or {})

    def __getstate__(self):  # the compiled template does not pickle; workers recompile it
        state = dict(self.__dict__)
        state["_compiled"] = None
        return state

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if self._compiled is None:
            try:
                from transformers.utils.chat_template_utils import _compile_jinja_template

                self._compiled = _compile_jinja_template(self.template_text)
            except ImportError:  # a transformers without the helper: the public (slower) path
                self._compiled = False
        if self._compiled is False:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        return self._compiled.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.variables,
        )

    def render_with_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The full rendering and the ``[start, end)`` character span of each assistant reply.

        Raises:
            Skip: ``template_error`` if the template raises, ``template_not_prefix`` if a prefix
                rendering is not a prefix of the full one.
        """
        try:
            full = self.render(messages)
            spans = []
            for k, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                before = self.render(messages[:k], add_generation_prompt=True) if k else ""
                through = full if k == len(messages) - 1 else self.render(messages[: k + 1])
                if not full.startswith(through):
                    raise Skip("template_not_prefix")
                start = (
                    len(before)
                    if through.startswith(before)
                    else _common_prefix_len(before, through)
                )
                if start < len(through):
                    spans.append((start, len(through)))
        except Skip:
            raise
        except Exception:  # jinja TemplateError, raise_exception(...) in the template, ...
            raise Skip("template_error") from None
        return full, spans


def _common_prefix_len(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search on prefix equality: O(n log n) in C string compares
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def end_of_turn_ids(tokenizer) -> set[int]:
    """The eos token and the known end-of-turn tokens that exist in this vocabulary."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def span_token_mask(
    encoding, ids: np.ndarray, spans: list[tuple[int, int]], eot_ids: set[int]
) -> np.ndarray:
    """Loss mask ``[T]`` (int8) of one tokenized rendering from its assistant character spans.

    ``encoding`` is the ``tokenizers.Encoding`` of the full text and ``ids`` its ids ``[T]``. A
    token that overlaps a span is in the mask; tokens after the span's last end-of-turn token are
    not. Python work is per span (a few ``char_to_token`` calls), never per token.
    """
    mask = np.zeros(len(ids), dtype=np.int8)
    for start, end in spans:
        t0 = _char_token(encoding, start, end, +1)
        t1 = _char_token(encoding, end - 1, start - 1, -1)
        if t0 is None or t1 is None or t1 < t0:
            continue
        # drop a tail after the end-of-turn token (at most a few tokens: "\n" in ChatML)
        for t in range(t1, max(t0, t1 - 8) - 1, -1):
            if int(ids[t]) in eot_ids:
                t1 = t
                break
        mask[t0 : t1 + 1] = 1
    return mask


def _char_token(encoding, pos: int, stop: int, step: int):
    """The token holding character ``pos``, walking towards ``stop`` past uncovered characters."""
    while pos != stop:
        t = encoding.char_to_token(pos)
        if t is not None:
            return t
        pos += step
    return None


# ---------------------------------------------------------------------------------------------
# the worker: a chunk of records → flat token arrays


@dataclass
class Chunk:
    ids: list[str]
    lengths: np.ndarray  # [rows] int64
    input_ids: np.ndarray  # [sum(lengths)] int32
    loss_mask: np.ndarray | None  # [sum(lengths)] int8, None in "arrays" mode
    stats: dict
    n_records: int = 0  # input records this chunk came from


class Encoder:
    """Turns a list of Records into rows. ``mode="mask"``: input_ids + loss_mask, truncated to
    ``max_length`` (documents split into windows) unless ``pack`` (then the parent packs);
    ``mode="arrays"``: the full rendering's ids only."""

    def __init__(self, tokenizer, mode: str, max_length: int | None, pack: bool):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise DataError(
                f"{type(tokenizer).__name__} is not a fast tokenizer; redraft.data needs one "
                f"(load it with AutoTokenizer.from_pretrained(..., use_fast=True))."
            )
        self.backend = backend
        self.renderer = (
            ChatRenderer(tokenizer) if getattr(tokenizer, "chat_template", None) else None
        )
        self.eot_ids = end_of_turn_ids(tokenizer)
        self.mode, self.max_length, self.pack = mode, max_length, pack

    def __call__(self, records: list[Record]) -> Chunk:
        stats = DataStats()
        # rows[i]: the (id, ids, mask) rows of records[i]; filled by kind, emitted in record order
        rows: list[list] = [[] for _ in records]
        chats, docs = [], []  # (record index, text, spans)
        for i, r in enumerate(records):
            if r.kind == "doc":
                docs.append((i, r.text, None))
                continue
            if self.renderer is None:
                raise DataError(
                    "The tokenizer has no chat template, so chat data cannot be rendered."
                )
            try:
                if self.mode == "mask":
                    text, spans = self.renderer.render_with_spans(r.messages)
                else:
                    text, spans = self.renderer.render(r.messages), None
            except Skip as skip:
                stats.skip(skip.reason)
                continue
            chats.append((i, text, spans))
        if chats:
            encodings = self.backend.encode_batch(
                [t for _, t, _ in chats], add_special_tokens=False
            )
            for (i, _, spans), enc in zip(chats, encodings):
                ids = np.asarray(enc.ids, dtype=np.int32)
                if self.mode == "arrays":
                    rows[i].append((records[i].id, ids, None))
                    continue
                mask = span_token_mask(enc, ids, spans, self.eot_ids)
                if not self.pack and self.max_length is not None:
                    ids, mask = ids[: self.max_length], mask[: self.max_length]
                if not mask.any():
                    stats.skip("no_loss_tokens")
                    continue
                rows[i].append((records[i].id, ids, mask))
        if docs:
            encodings = self.backend.encode_batch([t for _, t, _ in docs], add_special_tokens=True)
            for (i, _, _), enc in zip(docs, encodings):
                rid, ids = records[i].id, np.asarray(enc.ids, dtype=np.int32)
                if (
                    self.mode == "arrays"
                    or self.pack
                    or self.max_length is None
                    or len(ids) <= self.max_length
                ):
                    windows = [(rid, ids)]
                else:  # a long document becomes consecutive windows, each a row of its own
                    windows = [
                        (f"{rid}#{w}", ids[s : s + self.max_length])
                        for w, s in enumerate(range(0, len(ids), self.max_length))
                    ]
                for wid, w in windows:
                    if len(w) >= 2:
                        mask = np.ones(len(w), dtype=np.int8) if self.mode == "mask" else None
                        rows[i].append((wid, w, mask))
        flat_rows = [row for per_record in rows for row in per_record]
        lengths = np.fromiter((len(r[1]) for r in flat_rows), dtype=np.int64, count=len(flat_rows))
        flat = np.concatenate([r[1] for r in flat_rows]) if flat_rows else np.zeros(0, np.int32)
        flat_mask = None
        if self.mode == "mask":
            flat_mask = (
                np.concatenate([r[2] for r in flat_rows]) if flat_rows else np.zeros(0, np.int8)
            )
        return Chunk(
            [r[0] for r in flat_rows], lengths, flat, flat_mask, stats.to_dict(), len(records)
        )


_WORKER_ENCODER: Encoder | None = None


def _worker_init(encoder: Encoder) -> None:
    global _WORKER_ENCODER
    # Ctrl-C reaches the whole process group: only the parent handles it (it closes the pool),
    # so the user sees one line instead of a traceback from every worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER_ENCODER = encoder


def _worker_run(records: list[Record]) -> Chunk:
    return _WORKER_ENCODER(records)


def _fork_pool(ctx, num_proc: int, encoder: Encoder):
    """A worker pool whose workers are forked with SIGTERM's default action.

    A forked worker inherits the parent's Python signal handlers; when the parent (a CLI) has a
    SIGTERM handler that raises, ``Pool.terminate()`` (which SIGTERMs the workers) can leave a
    worker alive forever and the parent waiting for it (reproduced: 30 pools of 2 workers hang
    within seconds). So the handler is set aside while the pool forks its workers.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        return ctx.Pool(num_proc, initializer=_worker_init, initargs=(encoder,))
    previous = (
        signal.signal(signal.SIGTERM, signal.SIG_DFL),
        signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        return ctx.Pool(num_proc, initializer=_worker_init, initargs=(encoder,))
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def map_chunks(encoder: Encoder, chunks: Iterator[list[Record]], num_proc: int) -> Iterator[Chunk]:
    """Encode chunks in order, ``num_proc`` at a time; at most ``2 * num_proc`` in flight so a
    streaming source is never read far ahead of the tokenizer."""
    if num_proc <= 1:
        for chunk in chunks:
            yield encoder(chunk)
        return
    ctx = mp.get_context("fork") if sys.platform.startswith("linux") else mp.get_context()
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # silences the fork warning; restored below
    try:
        with _fork_pool(ctx, num_proc, encoder) as pool:
            pending: deque = deque()
            for chunk in chunks:
                pending.append(pool.apply_async(_worker_run, (chunk,)))
                if len(pending) >= 2 * num_proc:
                    yield pending.popleft().get()
            while pending:
                yield pending.popleft().get()
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
