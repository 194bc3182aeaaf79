"""Records → token ids and assistant-only loss masks, in parallel, cached on disk.

The rendering, the loss-mask derivation (any chat template) and the worker pool are
:mod:`redraft.data.encode`; this module splits, packs, writes and caches.

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
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from redraft.data.encode import END_OF_TURN_TOKENS, ChatRenderer, Chunk, Encoder, map_chunks  # noqa: F401  (ChatRenderer, END_OF_TURN_TOKENS: re-exported)
from redraft.data.records import DataStats, Record, is_heldout
from redraft.data.sources import iter_records, source_state
from redraft.errors import DataError
from redraft.utils import require_extra

logger = logging.getLogger(__name__)

# Bump when the rows this module writes change for the same inputs (invalidates every cache).
FORMAT_VERSION = 1
SPLITS = ("train", "heldout", "all")
CHUNK_RECORDS = 256


def default_cache_dir() -> Path:
    from redraft.models.target import CACHE_ROOT

    return Path(CACHE_ROOT) / "data"


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
        "chat_template": hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[
            :16
        ],
        "special_tokens": getattr(tokenizer, "special_tokens_map", {}),
    }


def _cache_entry(kind: str, spec: str, tokenizer, settings: dict, cache_dir) -> tuple[Path, dict]:
    key = {
        "format": FORMAT_VERSION,
        "kind": kind,
        "spec": spec,
        "source": source_state(spec),
        "tokenizer": _tokenizer_key(tokenizer),
        "settings": settings,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", spec)[-48:].strip("_") or "data"
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"{kind}-{slug}-{digest}", key


def _split_filter(
    records: Iterator[Record], split: str, heldout_fraction: float, limit: int | None
):
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
        if final and len(ids) - n * self.L >= 2 and mask[n * self.L :].any():
            out_ids.append(ids[n * self.L :])
            out_mask.append(mask[n * self.L :])
            n += 1
        names = [f"pack-{self.rows + i}" for i in range(len(out_ids))]
        self.rows += len(out_ids)
        return names, out_ids, out_mask, n * self.L

    def add(self, chunk: Chunk) -> Chunk:
        ids = np.concatenate([self.ids, chunk.input_ids])
        mask = np.concatenate([self.mask, chunk.loss_mask])
        names, out_ids, out_mask, used = self._emit(ids, mask)
        self.ids, self.mask = ids[used:], mask[used:]
        return _rows_chunk(names, out_ids, out_mask, chunk.stats)

    def finish(self) -> Chunk:
        names, out_ids, out_mask, _ = self._emit(self.ids, self.mask, final=True)
        return _rows_chunk(names, out_ids, out_mask, {})


def _rows_chunk(names, ids, masks, stats) -> Chunk:
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    flat_mask = np.concatenate(masks) if masks else np.zeros(0, np.int8)
    return Chunk(names, lengths, flat, flat_mask, stats)


def _arrow_batch(chunk: Chunk, schema):
    import pyarrow as pa

    offsets = np.zeros(len(chunk.lengths) + 1, dtype=np.int32)  # per batch, so int32 is plenty
    np.cumsum(chunk.lengths, out=offsets[1:])
    cols = [
        pa.array(chunk.ids, pa.string()),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(chunk.input_ids, pa.int32())),
    ]
    if chunk.loss_mask is not None:
        cols.append(
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(chunk.loss_mask, pa.int8()))
        )
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def _build(
    kind: str,
    spec: str,
    tokenizer,
    *,
    split: str,
    heldout_fraction: float,
    max_length: int | None,
    pack: bool,
    limit: int | None,
    num_proc: int | None,
    cache_dir,
    progress: bool,
) -> Path:
    """Build (or find) the cached Arrow file for these settings; return its folder."""
    if pack and not max_length:
        raise DataError("pack=True needs a max_length (the length of each packed row).")
    settings = {
        "split": split,
        "heldout_fraction": heldout_fraction,
        "max_length": max_length,
        "pack": pack,
        "limit": limit,
    }
    entry, key = _cache_entry(kind, spec, tokenizer, settings, cache_dir)
    if (entry / "meta.json").is_file() and (entry / "data.arrow").is_file():
        return entry
    from tqdm.auto import tqdm

    mode = "arrays" if kind == "arrays" else "mask"
    schema = _schema(mode)
    encoder = Encoder(tokenizer, mode, max_length, pack)
    num_proc = num_proc if num_proc is not None else min(os.cpu_count() or 1, 8)
    stats = DataStats()
    records = _split_filter(iter_records(spec, stats=stats), split, heldout_fraction, limit)
    packer = _Packer(max_length) if pack and mode == "mask" else None

    tmp = _fresh_tmp(entry)
    t0 = time.perf_counter()
    bar = tqdm(desc=f"tokenizing {spec}", unit=" rec", disable=not progress, dynamic_ncols=True)
    try:
        chunks = map_chunks(encoder, _batched(records, CHUNK_RECORDS), num_proc)
        n, worker_stats = _write_rows(tmp / "data.arrow", schema, chunks, packer, bar, t0)
        bar.close()
        seconds = time.perf_counter() - t0
        meta = _meta(key, n, seconds, stats, worker_stats, split)
        summary = meta["summary"]
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        if n["rows"] == 0:  # legitimate (a small file's held-out split) but worth a word
            logger.warning(
                "data spec %r (split=%s) gave no rows: %s. Check the source, the split "
                "(heldout_fraction=%s) and max_length.",
                spec,
                split,
                summary,
                heldout_fraction,
            )
        _move_into_place(tmp, entry)
    except BaseException:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        print(
            f"{spec}: {summary}; {seconds:.1f} s ({n['records'] / max(seconds, 1e-9):,.0f} "
            f"records/s, {n['tokens'] / max(seconds, 1e-9):,.0f} tokens/s)",
            file=sys.stderr,
        )
    return entry


def _schema(mode: str):
    """The Arrow schema of the rows: id, input_ids, and loss_mask in ``mask`` mode."""
    import pyarrow as pa

    fields = [pa.field("id", pa.string()), pa.field("input_ids", pa.list_(pa.int32()))]
    if mode == "mask":
        fields.append(pa.field("loss_mask", pa.list_(pa.int8())))
    return pa.schema(fields)


def _meta(key: dict, n: dict, seconds: float, stats, worker_stats, split: str) -> dict:
    """The entry's meta.json: its key, counts, time, the source's and the tokenizer's stats and a
    one-line summary."""
    dropped = ", ".join(f"{k} {v:,}" for k, v in worker_stats.skipped.most_common()) or "none"
    summary = (
        f"read {stats.summary()}; split {split}: {n['records']:,} records, dropped while "
        f"tokenizing: {dropped}; {n['rows']:,} rows, {n['tokens']:,} tokens "
        f"({n['loss_tokens']:,} in the loss)"
    )
    return {
        "key": key,
        **n,
        "seconds": round(seconds, 3),
        "source_stats": stats.to_dict(),
        "tokenize_skipped": dict(worker_stats.skipped),
        "summary": summary,
    }


def _fresh_tmp(entry: Path) -> Path:
    """An empty folder of this process beside ``entry`` (stale ones of dead processes removed)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(entry)
    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _write_rows(path: Path, schema, chunks, packer, bar, t0: float) -> tuple[dict, DataStats]:
    """Every encoded chunk (packed with ``packer`` when given) appended to the Arrow stream at
    ``path``; the counts of records, rows, tokens and loss tokens, and the tokenizer's stats."""
    import pyarrow as pa

    n = {"records": 0, "rows": 0, "tokens": 0, "loss_tokens": 0}
    worker_stats = DataStats()
    with (
        pa.OSFile(str(path), "wb") as sink,
        pa.ipc.new_stream(sink, schema) as writer,
    ):

        def write(c: Chunk) -> None:
            if len(c.ids):
                writer.write_batch(_arrow_batch(c, schema))
                n["rows"] += len(c.ids)
                n["tokens"] += int(c.lengths.sum())
                n["loss_tokens"] += int(c.loss_mask.sum()) if c.loss_mask is not None else 0

        for chunk in chunks:
            n["records"] += chunk.n_records
            worker_stats.update(chunk.stats)
            write(packer.add(chunk) if packer else chunk)
            bar.update(chunk.n_records)
            bar.set_postfix_str(
                f"{n['tokens'] / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s", refresh=False
            )
        if packer:
            write(packer.finish())
    return n, worker_stats


def _move_into_place(tmp: Path, entry: Path) -> None:
    """``tmp`` renamed to ``entry``; when another process finished the same entry first, theirs is
    kept and ``tmp`` removed."""
    try:
        os.replace(tmp, entry)
    except OSError:  # another process finished the same entry first: use theirs
        shutil.rmtree(tmp, ignore_errors=True)


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


def build_token_dataset(
    spec: str,
    tokenizer,
    *,
    split: str = "train",
    max_length: int = 2048,
    pack: bool = False,
    heldout_fraction: float = 0.02,
    num_proc: int | None = None,
    cache_dir=None,
    limit: int | None = None,
    progress: bool = True,
):
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
    require_extra("train", "datasets", what="build_token_dataset (the training data)")
    from datasets import Dataset

    entry = _build(
        "tokens",
        spec,
        tokenizer,
        split=split,
        heldout_fraction=heldout_fraction,
        max_length=max_length,
        pack=pack,
        limit=limit,
        num_proc=num_proc,
        cache_dir=cache_dir,
        progress=progress,
    )
    return Dataset.from_file(str(entry / "data.arrow"))


def iter_token_arrays(
    spec: str,
    tokenizer,
    *,
    split: str = "all",
    heldout_fraction: float = 0.02,
    limit: int | None = None,
    num_proc: int | None = None,
    cache_dir=None,
    progress: bool = True,
    meta: dict | None = None,
) -> Iterator[np.ndarray]:
    """Yield the int32 token ids of each record: a chat's full rendering, a whole document.

    Built like :func:`build_token_dataset` (parallel, cached) without masks or truncation; the
    arrays are zero-copy views into the memory-mapped cache file (copy one to keep it past the
    next iteration if you write into it; they are read-only). ``meta``: a dict that receives the
    cache entry's :func:`cache_meta` (records kept and skipped, by reason) once iteration starts.
    """
    import pyarrow as pa

    entry = _build(
        "arrays",
        spec,
        tokenizer,
        split=split,
        heldout_fraction=heldout_fraction,
        max_length=None,
        pack=False,
        limit=limit,
        num_proc=num_proc,
        cache_dir=cache_dir,
        progress=progress,
    )
    if meta is not None:
        meta.update(cache_meta(entry))
    with pa.memory_map(str(entry / "data.arrow")) as source:
        reader = pa.ipc.open_stream(source)
        for batch in reader:
            col = batch.column("input_ids")
            offsets = col.offsets.to_numpy()
            values = col.values.to_numpy()
            for i in range(len(col)):
                yield values[offsets[i] : offsets[i + 1]]
