"""Records → token ids and assistant-only loss masks, in parallel, cached on disk.

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

Performance: rendering is Python (jinja), tokenizing is Rust; both run in ``num_proc`` worker
processes over chunks of records streamed from the source, and the parent appends each chunk
as an Arrow record batch, so a large corpus is never held in memory. The result is cached under
``CACHE_ROOT/data/`` keyed by the source (paths, sizes, mtimes), the tokenizer (fingerprint,
tokenizer.json, chat template) and the settings; a second call memory-maps the cached file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from redraft.data.records import DataStats, Record, Skip, is_heldout
from redraft.data.sources import iter_records, source_state
from redraft.errors import DataError

logger = logging.getLogger(__name__)

# Bump when the rows this module writes change for the same inputs (invalidates every cache).
FORMAT_VERSION = 1
SPLITS = ("train", "heldout", "all")
# Tokens that end a turn in common templates; only used to trim the span's tail (see above).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>",
                      "<|end_of_text|>", "<|return|>")
CHUNK_RECORDS = 256


def default_cache_dir() -> Path:
    from redraft.models.target import CACHE_ROOT

    return Path(CACHE_ROOT) / "data"


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
            raise DataError(f"The tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template, so "
                            f"chat data cannot be rendered. Use a chat model or document data (stack:, code-dir:).")
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
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        return self._compiled.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.variables)

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
                through = full if k == len(messages) - 1 else self.render(messages[:k + 1])
                if not full.startswith(through):
                    raise Skip("template_not_prefix")
                start = len(before) if through.startswith(before) else _common_prefix_len(before, through)
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


def span_token_mask(encoding, ids: np.ndarray, spans: list[tuple[int, int]], eot_ids: set[int]) -> np.ndarray:
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
        mask[t0:t1 + 1] = 1
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
class _Chunk:
    ids: list[str]
    lengths: np.ndarray  # [rows] int64
    input_ids: np.ndarray  # [sum(lengths)] int32
    loss_mask: np.ndarray | None  # [sum(lengths)] int8, None in "arrays" mode
    stats: dict
    n_records: int = 0  # input records this chunk came from


class _Encoder:
    """Turns a list of Records into rows. ``mode="mask"``: input_ids + loss_mask, truncated to
    ``max_length`` (documents split into windows) unless ``pack`` (then the parent packs);
    ``mode="arrays"``: the full rendering's ids only."""

    def __init__(self, tokenizer, mode: str, max_length: int | None, pack: bool):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise DataError(f"{type(tokenizer).__name__} is not a fast tokenizer; redraft.data needs one "
                            f"(load it with AutoTokenizer.from_pretrained(..., use_fast=True)).")
        self.backend = backend
        self.renderer = ChatRenderer(tokenizer) if getattr(tokenizer, "chat_template", None) else None
        self.eot_ids = end_of_turn_ids(tokenizer)
        self.mode, self.max_length, self.pack = mode, max_length, pack

    def __call__(self, records: list[Record]) -> _Chunk:
        stats = DataStats()
        # rows[i]: the (id, ids, mask) rows of records[i]; filled by kind, emitted in record order
        rows: list[list] = [[] for _ in records]
        chats, docs = [], []  # (record index, text, spans)
        for i, r in enumerate(records):
            if r.kind == "doc":
                docs.append((i, r.text, None))
                continue
            if self.renderer is None:
                raise DataError("The tokenizer has no chat template, so chat data cannot be rendered.")
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
            encodings = self.backend.encode_batch([t for _, t, _ in chats], add_special_tokens=False)
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
                if self.mode == "arrays" or self.pack or self.max_length is None or len(ids) <= self.max_length:
                    windows = [(rid, ids)]
                else:  # a long document becomes consecutive windows, each a row of its own
                    windows = [(f"{rid}#{w}", ids[s:s + self.max_length])
                               for w, s in enumerate(range(0, len(ids), self.max_length))]
                for wid, w in windows:
                    if len(w) >= 2:
                        mask = np.ones(len(w), dtype=np.int8) if self.mode == "mask" else None
                        rows[i].append((wid, w, mask))
        flat_rows = [row for per_record in rows for row in per_record]
        lengths = np.fromiter((len(r[1]) for r in flat_rows), dtype=np.int64, count=len(flat_rows))
        flat = np.concatenate([r[1] for r in flat_rows]) if flat_rows else np.zeros(0, np.int32)
        flat_mask = None
        if self.mode == "mask":
            flat_mask = np.concatenate([r[2] for r in flat_rows]) if flat_rows else np.zeros(0, np.int8)
        return _Chunk([r[0] for r in flat_rows], lengths, flat, flat_mask, stats.to_dict(), len(records))


_WORKER_ENCODER: _Encoder | None = None


def _worker_init(encoder: _Encoder) -> None:
    global _WORKER_ENCODER
    # Ctrl-C reaches the whole process group: only the parent handles it (it closes the pool),
    # so the user sees one line instead of a traceback from every worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER_ENCODER = encoder


def _worker_run(records: list[Record]) -> _Chunk:
    return _WORKER_ENCODER(records)


def _fork_pool(ctx, num_proc: int, encoder: _Encoder):
    """A worker pool whose workers are forked with SIGTERM's default action.

    A forked worker inherits the parent's Python signal handlers; when the parent (a CLI) has a
    SIGTERM handler that raises, ``Pool.terminate()`` (which SIGTERMs the workers) can leave a
    worker alive forever and the parent waiting for it (reproduced: 30 pools of 2 workers hang
    within seconds). So the handler is set aside while the pool forks its workers.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        return ctx.Pool(num_proc, initializer=_worker_init, initargs=(encoder,))
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL), signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return ctx.Pool(num_proc, initializer=_worker_init, initargs=(encoder,))
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def _map_chunks(encoder: _Encoder, chunks: Iterator[list[Record]], num_proc: int) -> Iterator[_Chunk]:
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


# ---------------------------------------------------------------------------------------------
# caching and writing


def _tokenizer_key(tokenizer) -> dict:
    from redraft.models.target import tokenizer_fingerprint

    backend = getattr(tokenizer, "backend_tokenizer", None)
    blob = backend.to_str() if backend is not None else ""
    template = getattr(tokenizer, "chat_template", None) or ""
    return {
        "fingerprint": tokenizer_fingerprint(tokenizer),
        "tokenizer_json": hashlib.sha256(blob.encode()).hexdigest()[:16],
        "chat_template": hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16],
        "special_tokens": getattr(tokenizer, "special_tokens_map", {}),
    }


def _cache_entry(kind: str, spec: str, tokenizer, settings: dict, cache_dir) -> tuple[Path, dict]:
    key = {"format": FORMAT_VERSION, "kind": kind, "spec": spec, "source": source_state(spec),
           "tokenizer": _tokenizer_key(tokenizer), "settings": settings}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", spec)[-48:].strip("_") or "data"
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"{kind}-{slug}-{digest}", key


def _split_filter(records: Iterator[Record], split: str, heldout_fraction: float, limit: int | None):
    if split not in SPLITS:
        raise DataError(f"split={split!r} is not one of {SPLITS}.")
    n = 0
    for r in records:
        if limit is not None and n >= limit:
            return
        if split != "all" and is_heldout(r.id, heldout_fraction) != (split == "heldout"):
            continue
        n += 1
        yield r


def _batched(it, n):
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


class _Packer:
    """Concatenates rows and cuts them into rows of exactly ``max_length`` tokens (the last may
    be shorter); vectorised over each chunk with one reshape."""

    def __init__(self, max_length: int):
        self.L = max_length
        self.ids = np.zeros(0, np.int32)
        self.mask = np.zeros(0, np.int8)
        self.rows = 0

    def _emit(self, ids, mask, final=False):
        n = len(ids) // self.L
        out_ids = list(ids[: n * self.L].reshape(n, self.L)) if n else []
        out_mask = list(mask[: n * self.L].reshape(n, self.L)) if n else []
        if final and len(ids) - n * self.L >= 2 and mask[n * self.L:].any():
            out_ids.append(ids[n * self.L:])
            out_mask.append(mask[n * self.L:])
            n += 1
        names = [f"pack-{self.rows + i}" for i in range(len(out_ids))]
        self.rows += len(out_ids)
        return names, out_ids, out_mask, n * self.L

    def add(self, chunk: _Chunk) -> _Chunk:
        ids = np.concatenate([self.ids, chunk.input_ids])
        mask = np.concatenate([self.mask, chunk.loss_mask])
        names, out_ids, out_mask, used = self._emit(ids, mask)
        self.ids, self.mask = ids[used:], mask[used:]
        return _rows_chunk(names, out_ids, out_mask, chunk.stats)

    def finish(self) -> _Chunk:
        names, out_ids, out_mask, _ = self._emit(self.ids, self.mask, final=True)
        return _rows_chunk(names, out_ids, out_mask, {})


def _rows_chunk(names, ids, masks, stats) -> _Chunk:
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    flat_mask = np.concatenate(masks) if masks else np.zeros(0, np.int8)
    return _Chunk(names, lengths, flat, flat_mask, stats)


def _arrow_batch(chunk: _Chunk, schema):
    import pyarrow as pa

    offsets = np.zeros(len(chunk.lengths) + 1, dtype=np.int32)  # per batch, so int32 is plenty
    np.cumsum(chunk.lengths, out=offsets[1:])
    cols = [pa.array(chunk.ids, pa.string()),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(chunk.input_ids, pa.int32()))]
    if chunk.loss_mask is not None:
        cols.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(chunk.loss_mask, pa.int8())))
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def _build(kind: str, spec: str, tokenizer, *, split: str, heldout_fraction: float, max_length: int | None,
           pack: bool, limit: int | None, num_proc: int | None, cache_dir, progress: bool) -> Path:
    """Build (or find) the cached Arrow file for these settings; return its folder."""
    if pack and not max_length:
        raise DataError("pack=True needs a max_length (the length of each packed row).")
    settings = {"split": split, "heldout_fraction": heldout_fraction, "max_length": max_length, "pack": pack,
                "limit": limit}
    entry, key = _cache_entry(kind, spec, tokenizer, settings, cache_dir)
    if (entry / "meta.json").is_file() and (entry / "data.arrow").is_file():
        return entry
    import pyarrow as pa
    from tqdm.auto import tqdm

    mode = "arrays" if kind == "arrays" else "mask"
    fields = [pa.field("id", pa.string()), pa.field("input_ids", pa.list_(pa.int32()))]
    if mode == "mask":
        fields.append(pa.field("loss_mask", pa.list_(pa.int8())))
    schema = pa.schema(fields)
    encoder = _Encoder(tokenizer, mode, max_length, pack)
    num_proc = num_proc if num_proc is not None else min(os.cpu_count() or 1, 8)
    stats = DataStats()
    records = _split_filter(iter_records(spec, stats=stats), split, heldout_fraction, limit)
    packer = _Packer(max_length) if pack and mode == "mask" else None

    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(entry)
    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    t0 = time.perf_counter()
    n_records = n_rows = n_tokens = n_loss = 0
    worker_stats = DataStats()
    bar = tqdm(desc=f"tokenizing {spec}", unit=" rec", disable=not progress, dynamic_ncols=True)
    try:
        with pa.OSFile(str(tmp / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:

            def write(c: _Chunk) -> None:
                nonlocal n_rows, n_tokens, n_loss
                if len(c.ids):
                    writer.write_batch(_arrow_batch(c, schema))
                    n_rows += len(c.ids)
                    n_tokens += int(c.lengths.sum())
                    n_loss += int(c.loss_mask.sum()) if c.loss_mask is not None else 0

            for chunk in _map_chunks(encoder, _batched(records, CHUNK_RECORDS), num_proc):
                n_records += chunk.n_records
                worker_stats.update(chunk.stats)
                write(packer.add(chunk) if packer else chunk)
                bar.update(chunk.n_records)
                bar.set_postfix_str(f"{n_tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s", refresh=False)
            if packer:
                write(packer.finish())
        bar.close()
        seconds = time.perf_counter() - t0
        dropped = ", ".join(f"{k} {v:,}" for k, v in worker_stats.skipped.most_common()) or "none"
        summary = (f"read {stats.summary()}; split {split}: {n_records:,} records, dropped while tokenizing: "
                   f"{dropped}; {n_rows:,} rows, {n_tokens:,} tokens ({n_loss:,} in the loss)")
        meta = {"key": key, "records": n_records, "rows": n_rows, "tokens": n_tokens, "loss_tokens": n_loss,
                "seconds": round(seconds, 3), "source_stats": stats.to_dict(),
                "tokenize_skipped": dict(worker_stats.skipped), "summary": summary}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        if n_rows == 0:  # legitimate (a small file's held-out split) but worth a word
            logger.warning("data spec %r (split=%s) gave no rows: %s. Check the source, the split "
                           "(heldout_fraction=%s) and max_length.", spec, split, summary, heldout_fraction)
        try:
            os.replace(tmp, entry)
        except OSError:  # another process finished the same entry first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        print(f"{spec}: {summary}; {seconds:.1f} s ({n_records / max(seconds, 1e-9):,.0f} records/s, "
              f"{n_tokens / max(seconds, 1e-9):,.0f} tokens/s)", file=sys.stderr)
    return entry


def _remove_stale_tmp(entry: Path) -> None:
    """Delete half-written folders of this entry left by processes that no longer run."""
    for old in entry.parent.glob(entry.name + ".tmp*"):
        try:
            os.kill(int(old.name.rsplit(".tmp", 1)[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(old, ignore_errors=True)
        except (ValueError, PermissionError):
            pass


def cache_meta(path: Path) -> dict:
    """The ``meta.json`` of a cache entry (counts, timing, skip summary)."""
    return json.loads((Path(path) / "meta.json").read_text())


# ---------------------------------------------------------------------------------------------
# public API


def build_token_dataset(spec: str, tokenizer, *, split: str = "train", max_length: int = 2048, pack: bool = False,
                        heldout_fraction: float = 0.02, num_proc: int | None = None, cache_dir=None,
                        limit: int | None = None, progress: bool = True):
    """Token ids and assistant-only loss masks of a data spec, as a ``datasets.Dataset``.

    Args:
        spec: a data spec (:mod:`redraft.data.sources`), e.g. ``"default-chat"``.
        tokenizer: the target's fast tokenizer (chat data needs its chat template).
        split: ``"train"``, ``"heldout"`` (records with :func:`is_heldout`) or ``"all"``.
        max_length: chats are truncated to it; documents are cut into windows of it; with
            ``pack`` every row is exactly this long (the last may be shorter).
        pack: concatenate all rows and cut them into rows of ``max_length``.
        heldout_fraction: the split's held-out share.
        num_proc: worker processes (default: the number of CPUs, at most 8; 1 = in process).
        cache_dir: where cached Arrow files live (default ``CACHE_ROOT/data``).
        limit: at most this many records of the split.
        progress: show a progress bar and print the summary to stderr.

    Returns:
        A memory-mapped ``datasets.Dataset`` with columns ``id`` (str), ``input_ids``
        (list[int32]) and ``loss_mask`` (list[int8] of 0/1, same length): 1 exactly on the
        assistant's tokens including each reply's end-of-turn token; 1 on every document token.
        Rows whose mask is all 0 after truncation are dropped. Row order follows the source.

    Raises:
        DataError: bad spec or file, no rows, a tokenizer without what the data needs.
    """
    from datasets import Dataset

    entry = _build("tokens", spec, tokenizer, split=split, heldout_fraction=heldout_fraction,
                   max_length=max_length, pack=pack, limit=limit, num_proc=num_proc, cache_dir=cache_dir,
                   progress=progress)
    return Dataset.from_file(str(entry / "data.arrow"))


def iter_token_arrays(spec: str, tokenizer, *, split: str = "all", heldout_fraction: float = 0.02,
                      limit: int | None = None, num_proc: int | None = None, cache_dir=None,
                      progress: bool = True, meta: dict | None = None) -> Iterator[np.ndarray]:
    """Yield the int32 token ids of each record: a chat's full rendering, a whole document.

    Built like :func:`build_token_dataset` (parallel, cached) without masks or truncation; the
    arrays are zero-copy views into the memory-mapped cache file (copy one to keep it past the
    next iteration if you write into it; they are read-only). ``meta``: a dict that receives the
    cache entry's :func:`cache_meta` (records kept and skipped, by reason) once iteration starts.
    """
    import pyarrow as pa

    entry = _build("arrays", spec, tokenizer, split=split, heldout_fraction=heldout_fraction, max_length=None,
                   pack=False, limit=limit, num_proc=num_proc, cache_dir=cache_dir, progress=progress)
    if meta is not None:
        meta.update(cache_meta(entry))
    with pa.memory_map(str(entry / "data.arrow")) as source:
        reader = pa.ipc.open_stream(source)
        for batch in reader:
            col = batch.column("input_ids")
            offsets = col.offsets.to_numpy()
            values = col.values.to_numpy()
            for i in range(len(col)):
                yield values[offsets[i]:offsets[i + 1]]
