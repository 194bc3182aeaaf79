"""The host statistics compiled: the path entries' acceptance rates (``HostStats.values`` and
``update``) and the node budget that maximises tokens per second (``best_budget_np``)."""

from __future__ import annotations

import numpy as np

from redraft.infer.spec.hostjit.njit import _njit


@_njit
def _stats_values(hits, tries, p0, p1, owner, group, has_group, B, P, L):
    """``HostStats.values``: per path entry the product of the rates along the path (float64
    products of the float32 rates, rounded once, as torch's CPU cumprod); each depth's rate has
    the one above it as its prior's mean (``HostStats.rates``)."""
    G, Dm = hits.shape[1], hits.shape[2]
    out = np.empty((B, P, L), np.float32)
    for b in range(B):
        for p in range(P):
            d = owner[p]
            g = group[b, p] if has_group else p
            g = min(max(g, 0), G - 1)
            prod = 1.0
            r = np.float32(0.0)
            for lv in range(L):
                if lv == 0:
                    r = np.float32((hits[d, g, 0] + p0) / (tries[d, g, 0] + p1))
                elif lv < Dm:  # the prior of depth lv: the rate of depth lv - 1
                    r = np.float32((hits[d, g, lv] + p1 * r) / (tries[d, g, lv] + p1))
                prod *= np.float64(r)
                out[b, p, lv] = np.float32(prod)
    return out


@_njit
def _stats_update(hits, tries, decay, owner, group, has_group, kept, pre):
    """``HostStats.update`` in place: the drafters seen are decayed once, then every entry whose
    parent was accepted counts as tried, as hit if it was accepted itself."""
    Dn, G, Dm = hits.shape
    B, P, L = kept.shape
    L_ = min(L, Dm)
    seen = np.zeros(Dn, np.bool_)
    for p in range(P):
        seen[owner[p]] = True
    for d in range(Dn):
        if seen[d]:
            for g in range(G):
                for lv in range(Dm):
                    hits[d, g, lv] *= decay
                    tries[d, g, lv] *= decay
    one = np.float32(1.0)
    for b in range(B):
        for p in range(P):
            d = owner[p]
            g = group[b, p] if has_group else p
            g = min(max(g, 0), G - 1)
            for lv in range(L_):
                if kept[b, p, lv] and lv <= pre[b, p]:
                    tries[d, g, lv] += one
                    if lv < pre[b, p]:
                        hits[d, g, lv] += one


# ------------------------------------------------------------------------- the budget


@_njit
def _best_budget(values, M, secs, overhead):
    """``hoststats.best_budget_np`` past its checks: the K in 0..M whose expected tokens per
    second, B + the K best node values summed over rows, over ``secs[K] + overhead``, is the
    largest (float32 like the torch rule: rows summed in order, the running sum in float64)."""
    B = values.shape[0]
    total = np.zeros(M, np.float32)
    for b in range(B):
        row = np.empty(values.shape[1], np.float32)
        for j in range(values.shape[1]):
            v = values[b, j]
            row[j] = min(max(v, np.float32(0.0)), np.float32(1.0))
        row = np.sort(row)[::-1]
        for j in range(M):
            total[j] += row[j]
    fb = np.float32(B)
    best, best_r = 0, np.float32(0.0)
    acc = 0.0
    for K in range(M + 1):
        if K:
            acc += np.float64(total[K - 1])
        r = (fb + np.float32(acc)) / (secs[K] + overhead)
        if K == 0 or r > best_r:
            best, best_r = K, r
    return best
