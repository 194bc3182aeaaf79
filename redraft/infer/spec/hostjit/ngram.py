"""Context matching compiled: the context drafter's and N-Grammys' rows of every batch row in
one kernel (``hostdraft.context_matches_np`` and ``ngrammys_np``)."""

from __future__ import annotations

import numpy as np

from redraft.infer.spec.hostjit.njit import _njit
from redraft.infer.spec.paths import PAD


@_njit
def _ngram_rows(cat, starts, n, q_min, q_max, k, w, V, window, ext, last, table_class, gpc, pad):
    """``hostdraft.context_matches_np`` (``ext`` empty) or ``ngrammys_np`` (``ext [V, KE, WE]``
    the extended table, ``last [B]``) on the rows ``cat[starts[b] : starts[b] + n[b]]``."""
    B = n.shape[0]
    paths = np.full((B, k, w), pad, np.int64)
    group = np.zeros((B, k), np.int64)
    kk = min(k, V)
    for b in range(B):
        s0, nb = starts[b], n[b]
        f = 0  # context rows filled
        if nb > q_min and nb >= 2:
            y = cat[s0 + nb - 1]
            # matches: (first continuation token, length, position), positions ascending
            m_tok = np.empty(nb, np.int64)
            m_len = np.empty(nb, np.int64)
            m_pos = np.empty(nb, np.int64)
            m = 0
            for p in range(1, nb):
                if q_min >= 1:
                    if cat[s0 + p - 1] != y:
                        continue
                    ell = 1
                    i = 1
                else:
                    ell = 0
                    i = 0
                while i < q_max:
                    if p > i and nb - 1 > i and cat[s0 + p - 1 - i] == cat[s0 + nb - 1 - i]:
                        ell += 1
                        i += 1
                    else:
                        break
                if ell >= q_min and p - ell >= nb - window:
                    m_tok[m] = cat[s0 + p]
                    m_len[m] = ell
                    m_pos[m] = p
                    m += 1
            if m:
                # per first token: its longest length, the matches of that length, the latest
                order = np.argsort(m_tok[:m], kind="mergesort")  # positions stay ascending
                t_best = np.empty(m, np.int64)
                t_count = np.empty(m, np.int64)
                t_recent = np.empty(m, np.int64)
                nt = 0
                j = 0
                while j < m:
                    tok = m_tok[order[j]]
                    best, count, recent = -1, 0, -1
                    while j < m and m_tok[order[j]] == tok:
                        e = order[j]
                        if m_len[e] > best:
                            best, count, recent = m_len[e], 1, m_pos[e]
                        elif m_len[e] == best:
                            count += 1
                            recent = m_pos[e]
                        j += 1
                    t_best[nt], t_count[nt], t_recent[nt] = best, count, recent
                    nt += 1
                # longest first, then the most matches, then the latest ((best, count, recent) is
                # unique in a row: a position has one token)
                key = np.empty(nt, np.int64)
                for t in range(nt):
                    key[t] = -((t_best[t] * (m + 1) + t_count[t]) * (nb + 1) + t_recent[t])
                rank = np.argsort(key)
                f = min(kk, nt)
                cls_start, prev = 0, -1
                for slot in range(f):
                    t = rank[slot]
                    st = t_recent[t]
                    for c in range(w):
                        if st + c < nb:
                            paths[b, slot, c] = cat[s0 + st + c]
                    cls = q_max - t_best[t]
                    if cls != prev:
                        cls_start, prev = slot, cls
                    group[b, slot] = cls * gpc + min(slot - cls_start, gpc - 1)
        if ext.shape[0] == 0:
            continue
        # N-Grammys: the extended rows of the last token after the context rows that exist
        E = min(k, ext.shape[1])
        ww = min(w, ext.shape[2])
        y = last[b]
        slot = f
        for j in range(E):  # existing table rows, in order
            if slot >= k:
                break
            if ext[y, j, 0] >= 0:
                for c in range(ww):
                    paths[b, slot, c] = ext[y, j, c]
                group[b, slot] = table_class + min(j, gpc - 1)
                slot += 1
        # then the empty rows in order: the context rows past f (all PAD, group 0), then the
        # table rows that are empty
        slot = min(k, slot + k - f)  # (already PAD with group 0)
        for j in range(E):
            if slot >= k:
                break
            if ext[y, j, 0] < 0:
                for c in range(ww):
                    paths[b, slot, c] = ext[y, j, c]
                group[b, slot] = table_class + min(j, gpc - 1)
                slot += 1
    return paths, group


def ngram_rows(
    rows, q_min, q_max, k, w, vocab_size, window, gpc, ext=None, last=None, table_class=0
):
    """:func:`_ngram_rows` on a list of host token arrays (``gpc``: statistics groups per match
    length, ``hostdraft.GROUPS_PER_CLASS``)."""
    if len(rows) == 1:
        cat = np.asarray(rows[0], np.int64)
        n = np.array([len(cat)], np.int64)
        starts = _ZERO
    else:
        n = np.array([len(r) for r in rows], np.int64)
        cat = np.concatenate(rows).astype(np.int64, copy=False) if len(rows) else _ZERO
        starts = np.cumsum(n) - n
    if ext is None:
        ext, last = _NO_EXT, _ZERO
    else:
        last = np.asarray(last, np.int64)
    return _ngram_rows(
        cat,
        starts,
        n,
        q_min,
        q_max,
        k,
        w,
        vocab_size,
        window,
        ext,
        last,
        table_class,
        gpc,
        PAD,
    )


_ZERO = np.zeros(1, np.int64)
_NO_EXT = np.zeros((0, 1, 1), np.int32)
