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
directories, :mod:`redraft.ngrams.trigram_runs`; the counter and the counts,
:mod:`redraft.ngrams.trigram_counts` (their public names are re-exported here). This module
prunes the counts into the table type (:class:`~redraft.ngrams.trigram_table.TrigramTable`), which
imports nothing from here.
"""

from __future__ import annotations

import numpy as np

from redraft.errors import ConfigError, DataError
from redraft.ngrams.trigram_counts import (
    TrigramCounter,
    TrigramCounts,
    count_trigrams,
    load_counts,
    merge_counts,
)
from redraft.ngrams.trigram_keys import (
    make_keys,
    merge_runs,
    packable,
    sorted_counts,
    split_keys,
    trigram_keys,
)
from redraft.ngrams.trigram_runs import SpillDir, clean_stale_spills
from redraft.ngrams.trigram_table import TrigramTable, host_array

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
