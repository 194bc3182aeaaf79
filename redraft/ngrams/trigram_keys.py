"""Packed tri-gram keys and sorted runs of ``(key, count)``: the arithmetic under the counter.

A tri-gram ``(w1, w2, w3)`` of a vocabulary of size ``V`` is one int64 key
``(w1 * V + w2) * V + w3``; its context is ``w1 * V + w2``. Sorting keys groups tri-grams by
context, and a sorted run of unique keys with their counts is what the counter
(:mod:`redraft.ngrams.trigrams`) keeps, spills (:mod:`redraft.ngrams.trigram_runs`) and merges.

Vocabularies with ``V**3 >= 2**63`` cannot be packed into one int64: their keys become a
structured ``(context int64, w3 int64)`` record that numpy sorts field by field — slower, never
wrong (:func:`key_dtype`).
"""

from __future__ import annotations

import numpy as np

from redraft.errors import ConfigError

WIDE = np.dtype([("c", "<i8"), ("w", "<i8")])  # (w1 * V + w2, w3) for vocabularies too large


def packable(vocab_size: int) -> bool:
    """True when every key ``(w1 * V + w2) * V + w3`` fits in an int64 (``V**3 <= 2**63 - 1``).

    True up to V = 2,097,151 (2**21 - 1): every current LLM vocabulary.
    """
    return int(vocab_size) ** 3 <= 2**63 - 1


def key_dtype(vocab_size: int) -> np.dtype:
    """int64 packed keys, or the structured ``(context, w3)`` dtype when V is too large."""
    if int(vocab_size) * int(vocab_size) > 2**63 - 1:
        raise ConfigError(
            f"vocab size {vocab_size} is too large even for (w1*V + w2) context keys; "
            f"the tri-gram table supports vocabularies below 3e9."
        )
    return np.dtype(np.int64) if packable(vocab_size) else WIDE


def split_keys(keys: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys → ``(context = w1 * V + w2, w3)``, both int64."""
    if keys.dtype == WIDE:
        return np.asarray(keys["c"]), np.asarray(keys["w"])
    return np.divmod(keys, np.int64(vocab_size))


def make_keys(ctx: np.ndarray, w3: np.ndarray, vocab_size: int) -> np.ndarray:
    """Keys from ``(context = w1 * V + w2, w3)``: packed int64, or the wide dtype (module doc)."""
    if key_dtype(vocab_size) == WIDE:
        out = np.empty(len(ctx), WIDE)
        out["c"], out["w"] = ctx, w3
        return out
    return ctx * np.int64(vocab_size) + w3


def context_floor(keys: np.ndarray, vocab_size: int) -> np.ndarray:
    """The smallest key of each key's context (range boundaries must not split a context)."""
    ctx, _ = split_keys(keys, vocab_size)
    return make_keys(ctx, np.zeros_like(ctx), vocab_size)


def trigram_keys(tokens: np.ndarray, ends: np.ndarray, vocab_size: int) -> np.ndarray:
    """Keys of every tri-gram start position in records laid end to end in ``tokens``.

    Args:
        tokens: int ``[n]``, records concatenated.
        ends: int ``[r]``, exclusive end offset of each record in ``tokens`` (ascending).
        vocab_size: V.

    Returns:
        int64 packed keys ``[n - 2]`` where a position whose tri-gram would cross a record end
        holds ``-1`` (a sentinel that sorts first; :func:`sorted_counts` drops it), or, for the
        wide dtype, only the valid keys.
    """
    n = len(tokens)
    if n < 3:
        return np.empty(0, key_dtype(vocab_size))
    # The last two positions of every record start a tri-gram that crosses its end. For a record
    # of length < 2 these indices fall into the previous record's last positions: masked anyway.
    cross = np.concatenate([ends - 1, ends - 2])
    cross = cross[(cross >= 0) & (cross < n - 2)]
    V = np.int64(vocab_size)
    if key_dtype(vocab_size) == WIDE:
        t = tokens.astype(np.int64, copy=False)
        valid = np.ones(n - 2, dtype=bool)
        valid[cross] = False
        return make_keys((t[:-2] * V + t[1:-1])[valid], t[2:][valid], vocab_size)
    # (w1 * V + w2) * V + w3 in place: one [n-2] int64 buffer, no temporaries.
    keys = np.multiply(tokens[:-2], V, dtype=np.int64)
    keys += tokens[1:-1]
    keys *= V
    keys += tokens[2:]
    keys[cross] = -1
    return keys


def sorted_counts(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique keys (ascending) and how often each occurs: a run. Sorts ``keys`` in place.

    Negative (sentinel) keys of :func:`trigram_keys` are dropped.
    """
    if len(keys) == 0:
        return keys, np.empty(0, np.int64)
    keys.sort()
    if keys.dtype != WIDE:
        keys = keys[np.searchsorted(keys, 0) :]  # drop the -1 sentinels (they sort first)
        if len(keys) == 0:
            return keys, np.empty(0, np.int64)
    change = np.empty(len(keys), dtype=bool)
    change[0] = True
    change[1:] = keys[1:] != keys[:-1]
    starts = np.flatnonzero(change)
    counts = np.diff(starts, append=len(keys))
    return keys[starts], counts


def merge_runs(runs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Merge sorted ``(keys, counts)`` runs into one sorted run, summing counts of equal keys."""
    runs = [r for r in runs if len(r[0])]
    if not runs:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    if len(runs) == 1:
        return np.asarray(runs[0][0]), np.asarray(runs[0][1])
    keys = np.concatenate([r[0] for r in runs])
    counts = np.concatenate([r[1] for r in runs])
    order = np.argsort(keys, kind="stable")  # timsort: linear passes over the pre-sorted runs
    keys, counts = keys[order], counts[order]
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    return keys[starts], np.add.reduceat(counts, starts)
