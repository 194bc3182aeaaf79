"""Corpus tri-gram counts and the pruned ADED table ``P(w3 | w1, w2) = C(w1,w2,w3) / C(w1,w2)``.

Counting is vectorised: each chunk of records (``chunk_tokens`` tokens) becomes one int64 array
of packed keys ``(w1 * V + w2) * V + w3``, ``np.sort`` sorts it, and a ``!=`` against the shifted
array finds the runs of equal keys: one sorted run of ``(key, count)`` per chunk. Runs are merged
with a stable argsort (timsort merges pre-sorted runs in linear passes) and ``np.add.reduceat``.
A tri-gram never spans two records (chats, files): positions that would cross a record end are
masked out.

Memory stays bounded for corpora larger than RAM: when the merged in-memory run exceeds
``memory_mb``, it is spilled to disk (raw int64 files) and counting goes on; at the end the
spilled runs are merged range by range (key ranges aligned to contexts, each run sliced with
``searchsorted`` on a memory map), so only one range is in memory at a time. The same range merge
combines the partial counts of sharded builds (:func:`merge_counts`): a merged result equals a
single build.

The keys and runs are :mod:`redraft.ngrams.trigram_keys`; runs on disk and the spill
directories, :mod:`redraft.ngrams.trigram_runs` (their public names are re-exported here). This
module builds the table type (:class:`~redraft.ngrams.trigram_table.TrigramTable`), which
imports nothing from here.
"""

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
    make_keys,
    merge_runs,
    packable,
    sorted_counts,
    split_keys,
    trigram_keys,
)
from redraft.ngrams.trigram_runs import (
    COUNTS_FORMAT,
    COUNTS_FORMAT_VERSION,
    SpillDir,
    clean_stale_spills,
    open_run,
    write_run,
)
from redraft.ngrams.trigram_table import TrigramTable, host_array

logger = logging.getLogger("redraft.ngrams")


# --------------------------------------------------------------------------------------------
# counting


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


# --------------------------------------------------------------------------------------------
# the pruned table


def _prune_block(keys: np.ndarray, counts: np.ndarray, V: int, t: int, min_count: int):
    """One context-aligned block of sorted counts → its part of the CSR table."""
    ctx, w3 = split_keys(keys, V)
    starts = np.flatnonzero(np.concatenate(([True], ctx[1:] != ctx[:-1])))
    ctx_total = np.add.reduceat(counts, starts)  # [G] C(w1, w2)
    gid = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(ctx))))  # [n]
    keep = counts >= min_count
    gid, w3, counts = gid[keep], w3[keep], counts[keep]
    # By group, then count descending; lexsort is stable, so ties keep ascending w3 order.
    order = np.lexsort((-counts, gid))
    gid, w3, counts = gid[order], w3[order], counts[order]
    first = np.flatnonzero(np.concatenate(([True], gid[1:] != gid[:-1]))) if len(gid) else gid
    rank = np.arange(len(gid)) - np.repeat(first, np.diff(np.append(first, len(gid))))
    top = rank < t
    gid, w3, counts = gid[top], w3[top], counts[top]
    groups, per_group = np.unique(gid, return_counts=True)  # contexts that keep ≥ 1 successor
    return (
        ctx[starts][groups],
        per_group,
        w3.astype(np.int32),
        (counts / ctx_total[gid]).astype(np.float32),
        ctx_total[groups],
    )


def build_trigram_table(
    counts: TrigramCounts, t: int = 12, min_count: int = 1, progress: bool = False
) -> TrigramTable:
    """Prune counts to the top-``t`` successors (count ≥ ``min_count``) of every context.

    Returns:
        The :class:`~redraft.ngrams.trigram_table.TrigramTable`; ``P(w3 | w1, w2) =
        C(w1,w2,w3) / C(w1,w2)`` with ``C(w1,w2)`` counted before pruning, successors by count
        descending, ties by smaller id.

    Raises:
        DataError: the counts hold no tri-gram at all (empty corpus, records shorter than 3), or
            none reaches ``min_count``.
    """
    if t < 1 or min_count < 1:
        raise ConfigError(f"t and min_count must be at least 1 (got t={t}, min_count={min_count}).")
    V = counts.vocab_size
    parts = [
        _prune_block(k, c, V, int(t), int(min_count))
        for k, c in counts.iter_ranges(progress=progress)
        if len(k)
    ]
    stats = dict(counts.stats)
    if not parts:
        raise DataError(
            f"the corpus holds no tri-gram ({stats.get('records', 0)} records, "
            f"{stats.get('tokens', 0)} tokens): every record needs at least 3 tokens. "
            f"Check the --data spec."
        )
    ctx = np.concatenate([p[0] for p in parts])
    if len(ctx) == 0:
        raise DataError(
            f"no tri-gram occurs at least --min-count={min_count} times in the corpus "
            f"({stats.get('trigrams', 0)} tri-grams); lower --min-count."
        )
    offsets = np.zeros(len(ctx) + 1, np.int64)
    np.cumsum(np.concatenate([p[1] for p in parts]), out=offsets[1:])
    stats.update(contexts=int(len(ctx)), entries=int(offsets[-1]))
    return TrigramTable(
        ctx,
        offsets,
        np.concatenate([p[2] for p in parts]),
        np.concatenate([p[3] for p in parts]),
        V,
        t=int(t),
        min_count=int(min_count),
        context_counts=np.concatenate([p[4] for p in parts]),
        stats=stats,
    )


# --------------------------------------------------------------------------------------------
# small tables in memory (tests, benchmarks, scripts)


def trigram_table_from_trigrams(
    w1, w2, w3, counts, vocab_size: int, *, t: int = 12, min_count: int = 1
) -> TrigramTable:
    """A table from counted tri-grams ``(w1[i], w2[i], w3[i])`` seen ``counts[i]`` times.

    Any order; repeated tri-grams are summed. ``P(w3 | w1, w2) = C(w1,w2,w3) / C(w1,w2)``,
    pruned like the builder (:func:`build_trigram_table`, whose pruning this calls): top-``t``
    successors with count >= ``min_count``, ties by smaller id. An empty input gives an empty
    table.
    """
    w1, w2, w3 = (host_array(a, np.int64).reshape(-1) for a in (w1, w2, w3))
    counts = host_array(counts, np.int64).reshape(-1)
    V = int(vocab_size)
    if not w1.size == w2.size == w3.size == counts.size:
        raise ConfigError(
            f"trigram_table_from_trigrams needs equal lengths, got w1 {w1.size}, w2 {w2.size}, "
            f"w3 {w3.size}, counts {counts.size}."
        )
    for name, a in (("w1", w1), ("w2", w2), ("w3", w3)):
        if a.size and (a.min() < 0 or a.max() >= V):
            raise ConfigError(
                f"trigram_table_from_trigrams: {name} holds ids outside [0, {V}).", param=name
            )
    if counts.size and counts.min() < 1:
        raise ConfigError("trigram_table_from_trigrams: counts must be at least 1.", param="counts")
    if w1.size == 0:
        return TrigramTable.empty(V, t=t, min_count=min_count)
    keys = make_keys(w1 * V + w2, w3, V)
    order = np.argsort(keys, kind="stable")
    keys, counts = keys[order], counts[order]
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    run = (keys[starts], np.add.reduceat(counts, starts))  # unique keys, summed counts
    stats = {"trigrams": int(counts.sum())}
    return build_trigram_table(TrigramCounts(V, runs=[run], stats=stats), t=t, min_count=min_count)


def trigram_table_from_token_arrays(
    arrays, vocab_size: int, *, t: int = 12, min_count: int = 1, **counter_kwargs
) -> TrigramTable:
    """Count the tri-grams inside each token array (never across two) with the n-gram
    stage's counter (:func:`redraft.ngrams.count_trigrams`) and prune them
    (:func:`redraft.ngrams.build_trigram_table`). In memory: for tests, benchmarks, scripts.

    Args:
        arrays: an iterable of 1-D int arrays (lists work), one per record; e.g.
            ``redraft.data.iter_token_arrays(spec, tokenizer)``.
        counter_kwargs: ``chunk_tokens``, ``memory_mb``, ``spill_dir``, ``progress``.

    Raises:
        DataError: a token outside ``[0, V)`` (names the record), or no tri-gram at all.
    """
    counts = count_trigrams((np.asarray(a) for a in arrays), vocab_size, **counter_kwargs)
    try:
        return build_trigram_table(counts, t=t, min_count=min_count)
    finally:
        counts.cleanup()


__all__ = [
    "SpillDir",
    "TrigramCounter",
    "TrigramCounts",
    "build_trigram_table",
    "clean_stale_spills",
    "count_trigrams",
    "load_counts",
    "make_keys",
    "merge_counts",
    "merge_runs",
    "packable",
    "sorted_counts",
    "split_keys",
    "trigram_keys",
    "trigram_table_from_token_arrays",
    "trigram_table_from_trigrams",
]
