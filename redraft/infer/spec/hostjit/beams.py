"""ReDrafter's beams compiled: the beams' statistics groups and the plan of a beam's width and
length (``beamcost.plan_beam``'s arithmetic, ``ReDrafterDrafter._groups``)."""

from __future__ import annotations

import numpy as np

from redraft.infer.spec.hostjit.njit import _njit


@_njit
def _rank_bucket(p, buckets):
    """``beamcost.rank_bucket``: ranks 0, 1, 2-3, 4-7, 8+ -> 0, 1, 2, 3, 4 (its bit length)."""
    b = 0
    while p > 0:
        b += 1
        p >>= 1
    return min(b, buckets - 1)


@_njit
def _beam_groups(tokens, split, ema, max_split, buckets):
    """``ReDrafterDrafter._groups``: each beam's split depth (``beamcost.split_depth_np``,
    capped at ``max_split``) folded into the running frequencies ``split`` (in place, the same
    adds in the same order), and the beams' statistics groups ``[B, W]``."""
    B, W, L = tokens.shape
    f = np.zeros((B, W), np.int64)
    for b in range(B):
        for p in range(1, W):
            best = 0
            for q in range(p):
                c = 0
                while c < L and tokens[b, p, c] == tokens[b, q, c]:
                    c += 1
                best = max(best, c)
            f[b, p] = min(best, max_split)
    seen = np.zeros((W, split.shape[1]))
    inc = 1.0 / B
    for b in range(B):
        for p in range(W):
            seen[p, f[b, p]] += inc
    group = np.empty((B, W), np.int64)
    for p in range(W):
        for s in range(split.shape[1]):
            split[p, s] = ema * split[p, s] + (1 - ema) * seen[p, s]
        for b in range(B):
            group[b, p] = f[b, p] * buckets + _rank_bucket(p, buckets)
    return group


@_njit
def _plan_beam(rates, split, widths, lengths, vx, vy, beam_secs, batch, fixed, max_split, buckets):
    """``beamcost.plan_beam``'s arithmetic (see there): the best candidate's index and its
    expected tokens per second. ``vx, vy``: the verify-cost curve's points; ``beam_secs [C]``:
    each candidate's drafting seconds, candidates ordered (width, length) as ``widths x
    lengths``. Nodes of weight zero are skipped (they change neither the nodes nor the gain),
    and the cost curve is read with a moving pointer (the node count only grows)."""
    Wm, Lm = 0, 0
    for w in widths:
        Wm = max(Wm, w)
    for n in lengths:
        Lm = max(Lm, n)
    Wm = min(Wm, split.shape[0])
    S = split.shape[1]
    G, D0 = rates.shape
    v = np.empty((Wm, S, Lm))
    for p in range(Wm):
        for f in range(S):
            g = min(f, max_split) * buckets + _rank_bucket(p, buckets)
            prod = 1.0
            for lv in range(Lm):
                prod *= rates[g, min(lv, D0 - 1)]  # past the last depth: the last (edge)
                v[p, f, lv] = prod
    for lv in range(Lm):  # a lower-scored beam is no likelier; beam 0 splits only at depth 0
        for p in range(1, Wm):
            v[p, 0, lv] = min(v[p, 0, lv], v[p - 1, 0, lv])
            if p >= 2:
                for f in range(1, S):
                    v[p, f, lv] = min(v[p, f, lv], v[p - 1, f, lv])
    flat = v.reshape(-1)
    order = np.argsort(-flat, kind="mergesort")
    n_pts = vx.shape[0]
    y0 = vy[0]
    slope_end = (
        (vy[n_pts - 1] - vy[n_pts - 2]) / (vx[n_pts - 1] - vx[n_pts - 2]) if n_pts > 1 else 0.0
    )
    best_c, best_tps = 0, -1.0
    weight = np.zeros((Wm, S, Lm))
    depth_sum = np.zeros(Lm)
    scale = np.zeros(Lm)
    c = 0
    for W in widths:
        for L in lengths:
            depth_sum[:] = 0.0
            for p in range(Wm):
                for f in range(S):
                    for lv in range(Lm):
                        w = split[p, f] if (p < W and lv < L and lv >= f) else 0.0
                        weight[p, f, lv] = w
                        depth_sum[lv] += w * v[p, f, lv]
            cap = 1.0
            for lv in range(Lm):
                cap = min(cap, min(depth_sum[lv], 1.0))
                scale[lv] = cap / max(depth_sum[lv], 1e-12) if depth_sum[lv] > 0 else 0.0
            wflat = weight.reshape(-1)
            extra = beam_secs[c] + max(fixed, 0.0)
            nodes, gain, j = 0.0, 0.0, 0
            tps = -1.0
            k = -1
            while True:  # K = 0, then every node of positive weight, best value first
                x = batch * (1.0 + nodes)
                if n_pts == 1:
                    cost = y0
                else:
                    while j < n_pts - 2 and vx[j + 1] < x:
                        j += 1
                    if x > vx[n_pts - 1]:
                        cost = vy[n_pts - 1] + (x - vx[n_pts - 1]) * slope_end
                    elif x <= vx[0]:
                        cost = y0
                    else:
                        cost = vy[j] + (x - vx[j]) * (vy[j + 1] - vy[j]) / (vx[j + 1] - vx[j])
                    cost = max(cost, y0)
                t = batch * (1.0 + gain) / (cost + extra)
                if t > tps:
                    tps = t
                k += 1
                while k < order.shape[0]:
                    i = order[k]
                    lv = i % Lm
                    if wflat[i] * scale[lv] > 0:
                        break
                    k += 1
                if k >= order.shape[0]:
                    break
                i = order[k]
                ws = wflat[i] * scale[i % Lm]
                nodes += ws
                gain += ws * flat[i]
            if tps > best_tps:
                best_c, best_tps = c, tps
            c += 1
    return best_c, best_tps
