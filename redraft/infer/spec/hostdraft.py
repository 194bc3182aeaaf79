"""Learning-free drafting on the host: numpy mirrors of the n-gram drafters.

On a GPU every small tensor op of a decode step is a kernel launch; the n-gram drafters, the
acceptance statistics and the budget rule are a few hundred of them per step. Everything they
need is already on the host (the token lists of the rows, tables mirrored once in host memory),
so these functions do the same work in numpy: no kernels, tens of microseconds per step.

Each function returns exactly what its torch counterpart returns for the same inputs (the
tests compare them on random inputs):

=========================  ==================================================================
here                       torch original
=========================  ==================================================================
:func:`context_matches_np`  ``drafters.ngram.context_matches_multi``
:class:`HostTables`         ``NGramTables.extended / bigram_topk / unigram_topk``
:func:`ngrammys_np`         ``NGrammysDrafter.propose``
:func:`table_rows_np`       ``TableDrafter.propose``
=========================  ==================================================================

The acceptance rates and the budget (:class:`HostStats`, :func:`best_budget_np`, re-exported
here) are in :mod:`redraft.infer.spec.hoststats`; the tree built from the paths is in
:mod:`redraft.infer.spec.hosttree`.
"""

from __future__ import annotations

import numpy as np

from redraft.infer.spec import hostjit

# importable from here too (redraft.vllm.proposer imports HostStats from this module)
from redraft.infer.spec.hoststats import HostStats as HostStats
from redraft.infer.spec.hoststats import best_budget_np as best_budget_np
from redraft.infer.spec.paths import PAD

GROUPS_PER_CLASS = 4  # statistics groups per match length: ranks 0, 1, 2 and the rest


def _matches(
    cat: np.ndarray, n: np.ndarray, end: np.ndarray, q_min: int, q_max: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(cand, ell, rc, pc)``: the flat positions whose preceding tokens agree with their row's
    last ``q_min`` or more tokens, how many agree (capped at ``q_max``, at the position in the row
    and at the row's length - 1: ``context_matches_multi``'s ``ell >= q_min``), their rows and
    their positions in them. Row and position are found for the candidates only (a searchsorted
    over the rows' ends), not for every token of the batch: 64 rows of 600 tokens are 38k
    positions of which a few hundred are candidates."""
    start = end - n
    # suffix token i of each row [q_max, B]; -2 (no token) where the row is too short to use it
    ar = np.arange(q_max)[:, None]
    suffix = np.where(n - 1 > ar, cat[np.maximum(end - 1 - ar, 0)], -2)
    if q_min >= 1:  # the token before a match equals the row's last one: few positions do
        cand = np.flatnonzero(cat[:-1] == np.repeat(suffix[0], n)[1:]) + 1
        rc = np.searchsorted(end, cand, side="right")
        pc = cand - start[rc]
        keep = pc >= 1
        cand, rc, pc = cand[keep], rc[keep], pc[keep]
        first = 1
    else:
        rid = np.repeat(np.arange(len(n)), n)
        pos = np.arange(len(cat)) - start[rid]
        cand = np.flatnonzero(pos >= 1)
        rc, pc, first = rid[cand], pos[cand], 0
    ell = np.full(len(cand), first, dtype=np.int64)
    alive = np.ones(len(cand), dtype=bool)
    for i in range(
        first, q_max
    ):  # token p-1-i (in the same row while p > i) against suffix token i
        alive &= (pc > i) & (cat[np.maximum(cand - 1 - i, 0)] == suffix[i][rc])
        ell += alive
    return cand, ell, rc, pc


def _order(keys: list[tuple[np.ndarray, int]]) -> np.ndarray:
    """``np.lexsort`` of non-negative integer keys, most significant first, each given with a
    bound it stays below: one ``argsort`` of their mixed-radix combination where it fits in
    int64 (the keys are unique together, so no tie needs a stable sort) and the arrays are long,
    else ``lexsort``. (10,000 keys: 0.37 ms against 0.98 for two keys, 1.61 for four; below
    ~2,000 lexsort is faster.)"""
    total = 1
    for _, bound in keys:
        total *= max(int(bound), 1)
    if total >= 1 << 62 or len(keys[0][0]) < 2048:  # (lexsort is faster on short arrays)
        return np.lexsort(tuple(k for k, _ in reversed(keys)))
    combined = np.zeros(len(keys[0][0]), dtype=np.int64)
    for k, bound in keys:
        combined = combined * max(int(bound), 1) + k
    return np.argsort(combined)


def _run_starts(keys: np.ndarray) -> np.ndarray:
    """``[M]`` bool: where a run of equal keys starts in a sorted key array (the first entry
    included)."""
    starts = np.empty(len(keys), dtype=bool)
    starts[:1] = True
    np.not_equal(keys[1:], keys[:-1], out=starts[1:])
    return starts


def _first_of_run(keys: np.ndarray) -> np.ndarray:
    """``[M]``: for each entry of a sorted key array, the index where its run of equal keys starts."""
    return np.maximum.accumulate(np.where(_run_starts(keys), np.arange(len(keys)), 0))


def context_matches_np(
    rows, q_min: int, q_max: int, k: int, w: int, vocab_size: int, window: int = 4096
) -> tuple[np.ndarray, np.ndarray]:
    """Context matches of every length ``q_max .. q_min``, longest first, on host token lists.

    All rows are handled together on their concatenation (a fixed number of numpy calls per
    step, whatever the batch size).

    Args:
        rows: ``B`` 1-D integer arrays, ``rows[b]`` = the row's tokens (prompt + output so far,
            its last token being ``y``), i.e. ``tokens[b, :lengths[b]]``; ids in ``[0, vocab_size)``.
        q_min, q_max, k, w, vocab_size, window: as in ``context_matches_multi``.

    Returns:
        ``(paths int64 [B, k, w], group int64 [B, k])``, equal to
        ``context_matches_multi(tokens, lengths, ...)``.
    """
    if hostjit.ENABLED:
        return hostjit.ngram_rows(rows, q_min, q_max, k, w, vocab_size, window, GROUPS_PER_CLASS)
    B = len(rows)
    paths = np.full((B, k, w), PAD, dtype=np.int64)
    group = np.zeros((B, k), dtype=np.int64)
    n = np.array([len(r) for r in rows], dtype=np.int64)
    if not B or n.max() <= q_min:
        return paths, group
    cat = np.concatenate(rows).astype(np.int64, copy=False)  # [S]
    end = np.cumsum(n)
    cand, ell, rc, pc = _matches(cat, n, end, q_min, q_max)
    # a match at p (first continuation token p) of length >= q_min inside the row's window
    ok = (ell >= q_min) & (pc - ell >= n[rc] - window)
    cand, lc, rc, pc = cand[ok], ell[ok], rc[ok], pc[ok]
    if not len(cand):
        return paths, group
    # each first token competes in its longest match length (class), by count then recency there:
    # sort by (row, token, length, position); per (row, token) the last run of equal
    # (row, token, length) is its class, its length the best, its last position the most recent
    Q = q_max + 1
    key = (rc * vocab_size + cat[cand]) * Q + lc
    order = _order([(key, B * vocab_size * Q), (pc, int(n.max()))])
    ks, ps = key[order], pc[order]
    tok = ks // Q
    last = np.flatnonzero(_run_starts(tok[::-1])[::-1])  # last entry of each (row, token)
    best, recent, row = ks[last] % Q, ps[last], tok[last] // vocab_size
    count = last - _first_of_run(ks)[last] + 1
    # per row: longest class, then count, then recency ((best, count, recent) is unique in a row)
    top = _order(
        [
            (row, B),
            (q_max - best, Q),
            (len(cand) - count, len(cand)),
            (int(n.max()) - recent, int(n.max()) + 1),
        ]
    )
    row, best, start = row[top], best[top], recent[top]
    slot = np.arange(len(top)) - _first_of_run(row)  # rank inside the row
    keep = slot < min(k, vocab_size)
    row, best, start, slot = row[keep], best[keep], start[keep], slot[keep]
    cont = start[:, None] + np.arange(w)[None]  # [F, w] positions of the continuation
    nr = n[row][:, None]
    paths[row, slot] = np.where(
        cont < nr, cat[(end[row] - n[row])[:, None] + np.minimum(cont, nr - 1)], PAD
    )
    cls = q_max - best  # 0 = the longest match length (q_min <= best <= q_max)
    rank = slot - slot[_first_of_run(row * Q + cls)]  # rank among the row's rows of that class
    group[row, slot] = cls * GROUPS_PER_CLASS + np.minimum(rank, GROUPS_PER_CLASS - 1)
    return paths, group


def _np(x, dtype) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(x), dtype=dtype)


def _cols(k, have: int, name: str) -> int:
    """The columns to read (``NGramTables._cols``)."""
    if k is None:
        return have
    if not 1 <= int(k) <= have:
        from redraft.errors import ConfigError

        raise ConfigError(
            f"{name}={k} but the table stores {have} columns; rebuild with a larger {name}.",
            param=name,
        )
    return int(k)


class HostTables:
    """Host (numpy) copies of an ``NGramTables``' unigram / bigram / extended rows, made once.

    Ids are int32 and probabilities float32 (the stored float16, widened exactly as the torch
    lookups widen them), so a lookup is one fancy index into host memory.
    """

    def __init__(self, tables=None, *, unigram=None, bigram=None, extended=None):
        """``tables``: an ``NGramTables`` (every kind it holds of the three), or the arrays:
        ``unigram=(ids [k], probs [k])``, ``bigram=(ids [V, k], probs [V, k])``,
        ``extended=ids [V, k, w]`` (numpy or torch)."""
        if tables is not None:
            kinds = set(getattr(tables, "kinds", ()))
            if "unigram" in kinds:
                u = tables.table("unigram")
                unigram = (u["ids"], u["probs"])
            if "bigram" in kinds:
                b = tables.table("bigram")
                bigram = (b["ids"], b["probs"])
            if "extended" in kinds:
                extended = tables.table("extended")["ids"]
        self.unigram = (
            None if unigram is None else (_np(unigram[0], np.int32), _np(unigram[1], np.float32))
        )
        self.bigram = (
            None if bigram is None else (_np(bigram[0], np.int32), _np(bigram[1], np.float32))
        )
        self.ext = None if extended is None else _np(extended, np.int32)
        # log-probabilities and their exp (a fixed budget's node values), made once with torch's
        # own kernels: numpy's log differs from torch's in the last bit for ~20% of inputs
        self.unigram_logp, self.unigram_value = _logp(self.unigram)
        self.bigram_logp, self.bigram_value = _logp(self.bigram)

    def _need(self, kind: str, arr):
        if arr is None:
            from redraft.errors import ArtifactError

            raise ArtifactError(
                f"these host tables hold no {kind} table; load the n-gram artifact with "
                f"the {kind} kind (redraft-build-ngrams --kinds {kind})."
            )
        return arr

    def unigram_topk(self, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int64 [k], probs float32 [k])``."""
        ids, probs = self._need("unigram", self.unigram)
        k = _cols(k, ids.shape[0], "k")
        return ids[:k].astype(np.int64), probs[:k]

    def bigram_topk(self, last, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``last [N]`` -> ``(ids int64 [N, k], probs float32 [N, k])``."""
        ids, probs = self._need("bigram", self.bigram)
        k = _cols(k, ids.shape[1], "k")
        last = np.asarray(last, dtype=np.int64)
        return ids[last, :k].astype(np.int64), probs[last, :k]

    def extended(self, last, k: int | None = None, w: int | None = None) -> np.ndarray:
        """``last [N]`` -> ``ids int64 [N, k, w]`` (``[:, j, 0]`` is the j-th bigram successor)."""
        e = self._need("extended", self.ext)
        k = _cols(k, e.shape[1], "k")
        w = _cols(w, e.shape[2], "w")
        return e[np.asarray(last, dtype=np.int64), :k, :w].astype(np.int64)


def _logp(pair):
    """``(logp, exp(logp))`` float32 of a ``(ids, probs)`` table, as ``TableDrafter`` and the
    decoder compute them (``probs.clamp_min(1e-12).log()``, then ``.cumsum(-1).exp()``)."""
    if pair is None:
        return None, None
    import torch

    logp = torch.from_numpy(pair[1]).clamp_min(1e-12).log()
    return logp.numpy(), logp[..., None].cumsum(-1).exp()[..., 0].numpy()


def _pad_w(paths: np.ndarray, w: int) -> np.ndarray:
    """Right-pad (or cut) ``[..., L]`` to ``w`` with ``PAD`` (``pad_paths``)."""
    L = paths.shape[-1]
    if L >= w:
        return paths[..., :w]
    return np.concatenate(
        [paths, np.full((*paths.shape[:-1], w - L), PAD, dtype=paths.dtype)], axis=-1
    )


def ngrammys_np(
    rows,
    last,
    tables: HostTables,
    vocab_size: int,
    k: int,
    w: int,
    q: int,
    q_max: int | None = None,
    window: int = 4096,
) -> tuple[np.ndarray, np.ndarray]:
    """``NGrammysDrafter.propose`` on the host: context rows first, then the extended rows of
    ``last``; the first ``k`` that exist. Returns ``(paths int64 [B, k, w], group int64 [B, k])``."""
    q_max = max(q_max or q, q)
    table_class = (q_max - q + 1) * GROUPS_PER_CLASS
    if hostjit.ENABLED and tables.ext is not None:
        return hostjit.ngram_rows(
            rows,
            q,
            q_max,
            k,
            w,
            vocab_size,
            window,
            GROUPS_PER_CLASS,
            tables.ext,
            last,
            table_class,
        )
    ctx, cgroup = context_matches_np(rows, q, q_max, k, w, vocab_size, window)
    ext = _pad_w(tables.extended(last)[:, :k, :w], w)  # [B, E, w]
    B, E = ext.shape[:2]
    egroup = np.broadcast_to(table_class + np.minimum(np.arange(E), GROUPS_PER_CLASS - 1), (B, E))
    allp = np.concatenate([ctx, ext], axis=1)  # [B, k + E, w]
    group = np.concatenate([cgroup, egroup], axis=1)
    order = np.argsort(allp[:, :, 0] < 0, axis=1, kind="stable")[:, :k]  # rows that exist first
    return np.take_along_axis(allp, order[:, :, None], 1), np.take_along_axis(group, order, 1)


def table_rows_np(
    kind: str, tables: HostTables, last, k: int, w: int | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """``TableDrafter.propose`` on the host: ``(tokens int64 [B, P, L], logp float32 [B, P, L]
    or None)`` for ``kind`` "bigram", "extended" or "unigram" (``last [B]``)."""
    last = np.asarray(last, dtype=np.int64)
    B = len(last)
    if kind == "unigram":
        ids, _ = tables.unigram_topk(k)
        logp = tables.unigram_logp[: len(ids)]
        return (
            np.broadcast_to(ids[None, :, None], (B, len(ids), 1)).copy(),
            np.broadcast_to(logp[None, :, None], (B, len(ids), 1)).copy(),
        )
    if kind == "bigram":
        ids, _ = tables.bigram_topk(last, k)
        return ids[:, :, None], tables.bigram_logp[last, : ids.shape[1], None]
    if kind == "extended":
        ids = tables.extended(last)[:, :k]
        return (ids if w is None else ids[:, :, :w]), None
    from redraft.errors import ConfigError

    raise ConfigError(
        f"table drafter kind {kind!r} is unknown; use one of ('bigram', 'extended', 'unigram')."
    )


def table_values_np(kind: str, tables: HostTables, last, k: int, L: int) -> np.ndarray:
    """``[B, k, L]`` float32: the node values a fixed budget ranks a bigram or unigram drafter's
    paths by (the decoder's ``pad_paths(logp.cumsum(-1).exp(), L).clamp_min(0)``: the probability
    at depth 0, 0 after)."""
    last = np.asarray(last, dtype=np.int64)
    if kind == "unigram":
        tables._need("unigram", tables.unigram)
        k = _cols(k, len(tables.unigram_value), "k")
        v = np.broadcast_to(tables.unigram_value[None, :k], (len(last), k))
    elif kind == "bigram":
        tables._need("bigram", tables.bigram)
        k = _cols(k, tables.bigram_value.shape[1], "k")
        v = tables.bigram_value[last, :k]
    else:
        from redraft.errors import ConfigError

        raise ConfigError(
            f"table_values_np: kind {kind!r} carries no probabilities; use 'bigram' or 'unigram'."
        )
    out = np.zeros((len(last), k, max(L, 1)), dtype=np.float32)
    out[:, :, 0] = np.maximum(v, 0)
    return out[:, :, :L]
