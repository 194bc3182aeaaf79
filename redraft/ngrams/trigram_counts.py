"""Counting a corpus's tri-grams: chunks of records sorted into runs of ``(key, count)``, merged
in memory, spilled to disk past ``memory_mb`` and merged range by range at the end; partial
counts saved, loaded and merged (sharded builds). The algorithm is in
:mod:`redraft.ngrams.trigrams`' doc."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from redraft.errors import ArtifactError, ConfigError, DataError
from redraft.ngrams.trigram_keys import (
    WIDE,
    context_floor,
    key_dtype,
    merge_runs,
    sorted_counts,
    trigram_keys,
)
from redraft.ngrams.trigram_runs import (
    COUNTS_FORMAT,
    COUNTS_FORMAT_VERSION,
    SpillDir,
    open_run,
    write_run,
)

logger = logging.getLogger("redraft.ngrams")


@dataclass
class TrigramCounts:
    """Sorted tri-gram counts: in memory (``runs``) or spilled to disk (``spilled`` dirs).

    Iterate them in key order, a context range at a time, with :meth:`iter_ranges`.
    """

    vocab_size: int
    runs: list = field(default_factory=list)  # [(keys, counts)] sorted runs in memory
    spilled: list = field(default_factory=list)  # [Path] run directories
    stats: dict = field(default_factory=dict)  # records, tokens, trigrams
    memory_mb: int = 4096
    _tmpdir: object = None  # the SpillDir of ``spilled`` runs: lives as long as the counts

    def cleanup(self) -> None:
        """Delete the spilled runs now (they are private temporary files); idempotent.

        Run it when done with the counts, also on errors and Ctrl-C; otherwise they go when the
        counts are garbage collected. Shard directories given to :func:`load_counts` are
        never deleted.
        """
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self.spilled, self._tmpdir = [], None

    def __enter__(self) -> TrigramCounts:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    @property
    def num_entries_upper(self) -> int:
        """Distinct tri-grams, exactly when there is a single run, else an upper bound."""
        return sum(len(k) for k, _ in self.runs) + sum(
            json.loads((Path(d) / "meta.json").read_text())["entries"] for d in self.spilled
        )

    def iter_ranges(self, progress: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield sorted ``(keys, counts)`` blocks covering all tri-grams in ascending key order.

        Block boundaries fall on context starts, so every context lies in exactly one block.
        Memory: one block at a time (about ``memory_mb / 4`` of keys and counts).
        """
        sources = [r for r in self.runs if len(r[0])]
        sources += [open_run(d)[:2] for d in self.spilled]
        sources = [s for s in sources if len(s[0])]
        if not sources:
            return
        total = sum(len(k) for k, _ in sources)
        per_block = max(1, (self.memory_mb * 2**20 // 4) // 48)  # 16 B/entry, ~3 copies
        n_blocks = max(1, -(-total // per_block))
        if n_blocks == 1:
            yield merge_runs([(np.asarray(k), np.asarray(c)) for k, c in sources])
            return
        # Boundaries: evenly spaced keys of the largest run, floored to their context's start.
        big = max(sources, key=lambda s: len(s[0]))[0]
        picks = big[np.linspace(0, len(big) - 1, n_blocks + 1).astype(np.int64)[1:-1]]
        bounds = np.unique(context_floor(np.asarray(picks), self.vocab_size))
        cuts = [np.concatenate(([0], np.searchsorted(k, bounds), [len(k)])) for k, _ in sources]
        bar = tqdm(
            total=total,
            desc="merge tri-gram counts",
            unit="entry",
            unit_scale=True,
            disable=not progress,
        )
        for b in range(len(bounds) + 1):
            parts = [
                (np.asarray(k[c[b] : c[b + 1]]), np.asarray(v[c[b] : c[b + 1]]))
                for (k, v), c in zip(sources, cuts)
            ]
            bar.update(sum(len(p[0]) for p in parts))
            yield merge_runs(parts)
        bar.close()

    def save(self, directory, meta: dict | None = None) -> Path:
        """Write the counts as one sorted run (``keys.bin``, ``counts.bin``, ``meta.json``).

        These are a shard's partial counts; :func:`merge_counts` combines shards.
        """
        directory = Path(directory)
        # One name per shard, not per process: a rerun of a killed shard replaces its leftovers.
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        n = 0
        wide = key_dtype(self.vocab_size) == WIDE
        sha = {"keys.bin": hashlib.sha256(), "counts.bin": hashlib.sha256()}
        try:
            with open(tmp / "keys.bin", "wb") as fk, open(tmp / "counts.bin", "wb") as fc:
                for keys, counts in self.iter_ranges():  # streamed: bounded memory
                    for f, name, a in ((fk, "keys.bin", keys), (fc, "counts.bin", counts)):
                        b = np.ascontiguousarray(
                            a, dtype=None if name == "keys.bin" else np.int64
                        ).tobytes()
                        f.write(b)
                        sha[name].update(b)
                    n += len(keys)
            info = dict(
                meta or {},
                vocab_size=self.vocab_size,
                stats=self.stats,
                format=COUNTS_FORMAT,
                format_version=COUNTS_FORMAT_VERSION,
                entries=n,
                key_dtype="wide" if wide else "int64",
                sha256={name: h.hexdigest() for name, h in sha.items()},
            )
            (tmp / "meta.json").write_text(json.dumps(info, indent=2))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
        return directory


class TrigramCounter:
    """Streaming, vectorised tri-gram counter. ``add`` records, then ``finish``.

    Args:
        vocab_size: V; every token must be in ``[0, V)``.
        chunk_tokens: tokens gathered before one sort (memory ≈ 24 bytes per token).
        memory_mb: in-memory budget for merged counts; beyond it they are spilled to ``spill_dir``.
        spill_dir: the folder under which a private spill directory is made (default: the
            system temp dir); see :class:`SpillDir`.
    """

    def __init__(
        self,
        vocab_size: int,
        chunk_tokens: int = 1 << 25,
        memory_mb: int = 4096,
        spill_dir=None,
        progress: bool = False,
        desc: str = "count tri-grams",
    ):
        self.vocab_size = int(vocab_size)
        key_dtype(self.vocab_size)  # raises for impossible vocabularies
        self.chunk_tokens = int(chunk_tokens)
        self.memory_mb = int(memory_mb)
        self._spill_root = Path(spill_dir) if spill_dir is not None else None
        self._tmp = None
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []
        self._spilled: list[Path] = []
        self.records = 0
        self.tokens = 0
        self.trigrams = 0
        self._bar = tqdm(desc=desc, unit="tok", unit_scale=True, disable=not progress)

    def add(self, tokens) -> None:
        """Count one record (a 1-D int array of token ids)."""
        a = np.asarray(tokens)
        if not a.flags.writeable:  # a view into a reader's memory map: own it until the flush
            a = a.copy()
        if a.ndim != 1:
            raise DataError(
                f"record {self.records} is an array of shape {a.shape}; expected a "
                f"1-D array of token ids (one record = one chat or one document)."
            )
        self._pending.append(a)
        self._pending_tokens += len(a)
        self.records += 1
        if self._pending_tokens >= self.chunk_tokens:
            self._flush()

    def add_many(self, arrays: Iterable) -> TrigramCounter:
        for a in arrays:
            self.add(a)
        return self

    def _flush(self) -> None:
        if not self._pending:
            return
        lengths = np.fromiter((len(a) for a in self._pending), np.int64, len(self._pending))
        tokens = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        first_record = self.records - len(self._pending)
        self._pending, self._pending_tokens = [], 0
        if len(tokens):
            lo, hi = tokens.min(), tokens.max()
            if lo < 0 or hi >= self.vocab_size:
                bad = int(np.flatnonzero((tokens < 0) | (tokens >= self.vocab_size))[0])
                rec = first_record + int(np.searchsorted(np.cumsum(lengths), bad, side="right"))
                raise DataError(
                    f"record {rec} holds token id {int(tokens[bad])}, outside the vocabulary "
                    f"[0, {self.vocab_size}). Tokenize the corpus with the target's tokenizer."
                )
        keys, counts = sorted_counts(trigram_keys(tokens, np.cumsum(lengths), self.vocab_size))
        self.tokens += len(tokens)
        self.trigrams += int(counts.sum())
        self._runs.append((keys, counts))
        self._bar.update(len(tokens))
        entries = sum(len(k) for k, _ in self._runs)
        if len(self._runs) >= 8 or entries * 16 > self.memory_mb * 2**20 // 2:
            self._runs = [merge_runs(self._runs)]
            if len(self._runs[0][0]) * 16 > self.memory_mb * 2**20 // 2:
                self._spill()

    def _spill(self) -> None:
        if self._tmp is None:  # a private directory: concurrent counters never collide
            self._tmp = SpillDir(
                self._spill_root if self._spill_root is not None else tempfile.gettempdir()
            )
        root = self._tmp.path
        keys, counts = self._runs.pop()
        self._spilled.append(
            write_run(
                root / f"run-{len(self._spilled):05d}",
                keys,
                counts,
                {"vocab_size": self.vocab_size},
            )
        )

    def cleanup(self) -> None:
        """Delete this counter's spilled runs (after an error or Ctrl-C); idempotent."""
        self._bar.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def finish(self) -> TrigramCounts:
        """Count what is pending and return the :class:`TrigramCounts` (which then own the
        spilled runs: call their :meth:`TrigramCounts.cleanup`)."""
        self._flush()
        self._bar.close()
        runs = [merge_runs(self._runs)] if self._runs else []
        return TrigramCounts(
            self.vocab_size,
            runs=runs,
            spilled=list(self._spilled),
            stats={"records": self.records, "tokens": self.tokens, "trigrams": self.trigrams},
            memory_mb=self.memory_mb,
            _tmpdir=self._tmp,
        )


def count_trigrams(
    arrays: Iterable,
    vocab_size: int,
    *,
    chunk_tokens: int = 1 << 25,
    memory_mb: int = 4096,
    spill_dir=None,
    progress: bool = False,
) -> TrigramCounts:
    """Count the tri-grams of every record in ``arrays`` (1-D int arrays, one per record).

    Returns:
        :class:`TrigramCounts` (``stats``: records, tokens, trigrams); spilled runs, if any, are
        deleted by their ``cleanup()`` (or ``with counts: ...``) or when they are collected.

    Raises:
        DataError: a token id outside ``[0, vocab_size)`` (names the record).
    """
    counter = TrigramCounter(
        vocab_size,
        chunk_tokens=chunk_tokens,
        memory_mb=memory_mb,
        spill_dir=spill_dir,
        progress=progress,
    )
    try:
        return counter.add_many(arrays).finish()
    except BaseException:  # an error, Ctrl-C: no spilled run is left behind
        counter.cleanup()
        raise


def load_counts(
    directories: Iterable, memory_mb: int = 4096, check_complete: bool = True, verify: bool = True
) -> TrigramCounts:
    """Open shard counts written by :meth:`TrigramCounts.save` as one :class:`TrigramCounts`.

    Checks that all shards share one vocabulary, tokenizer fingerprint, data spec, split and
    limit; when the shards record ``num_shards``, that every shard id is present exactly once;
    and with ``verify`` each file's size and sha256 against its ``meta.json``.

    Raises:
        ArtifactError: a missing, truncated or changed shard, or shards of different builds.
    """
    dirs = [Path(d) for d in directories]
    if not dirs:
        raise ConfigError("no shard count directories given to merge.")
    metas = [open_run(d, verify=verify)[2] for d in dirs]
    for key in ("vocab_size", "tokenizer_fingerprint", "num_shards", "data", "split", "limit"):
        values = {json.dumps(m.get(key)) for m in metas}
        if len(values) > 1:
            listing = ", ".join(f"{d}: {m.get(key)}" for d, m in zip(dirs, metas))
            raise ArtifactError(
                f"shards disagree on {key}: {listing}. Merge only the shards of one build."
            )
    n = metas[0].get("num_shards")
    if check_complete and n:
        ids = sorted(int(m.get("shard_id", -1)) for m in metas)
        if ids != list(range(int(n))):
            missing = sorted(set(range(int(n))) - set(ids))
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ArtifactError(
                f"expected shards 0..{int(n) - 1} of {n} exactly once; missing {missing}"
                f"{f', duplicated {dup}' if dup else ''}. Run the missing shards, "
                f"or pass only the shards of one build."
            )
    stats = {
        k: sum(int(m.get("stats", {}).get(k, 0)) for m in metas)
        for k in ("records", "tokens", "trigrams")
    }
    return TrigramCounts(
        int(metas[0]["vocab_size"]), spilled=dirs, stats=stats, memory_mb=memory_mb
    )


def merge_counts(directories: Iterable, out_dir=None, memory_mb: int = 4096) -> TrigramCounts:
    """Combine shard counts; with ``out_dir`` also write the combined counts there."""
    counts = load_counts(directories, memory_mb=memory_mb)
    if out_dir is not None:
        counts.save(
            out_dir,
            meta={
                k: v
                for k, v in open_run(counts.spilled[0])[2].items()
                if k in ("tokenizer_fingerprint", "data")
            },
        )
        counts = load_counts([out_dir], memory_mb=memory_mb, check_complete=False, verify=False)
    return counts
