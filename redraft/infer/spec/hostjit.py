"""Compiled (numba) kernels of the decode step's host work: the same results as the numpy code.

A speculative step's host work at one row is a few hundred numpy calls of a few elements each
(context matching, the tree, the walk, the statistics), each costing ~1-3 us of dispatch: on a
GPU that was more host time a step for N-Grammys than the verify of the default target
(docs/design/0003-host-kernels.md). Loops compiled by numba do the same work per row in microseconds, the way
vLLM's n-gram proposer does (numba, for the same reason). Each kernel here returns exactly what
its numpy counterpart returns (tests compare them on random inputs, ties included); the numpy
functions stay as the reference and as the fallback where numba is missing or turned off
(``REDRAFT_JIT=0``).

Building a speculative decoder compiles the kernels (``decoder.warm_host_kernels``: seconds
the first time on a machine, then loaded from numba's disk cache in a fraction of a second), so no decode
step compiles. They release the GIL (``nogil``), so a server's event loop keeps running while
the decode thread is in them.
"""

from __future__ import annotations

import os

import numpy as np

from redraft.infer.spec.paths import PAD

try:  # numba is a dependency; without it (or with REDRAFT_JIT=0) the numpy code runs
    import numba
except Exception as exc:  # pragma: no cover - not installed, or built for another numpy
    numba, _IMPORT_ERROR = None, f"{type(exc).__name__}: {exc}"

ENABLED = numba is not None and os.environ.get("REDRAFT_JIT", "1") != "0"


def status() -> str:
    """Which host kernels run, in words (for benchmark tables and logs)."""
    if numba is None:
        return f"numpy (numba unavailable: {_IMPORT_ERROR})"
    if os.environ.get("REDRAFT_JIT", "1") == "0":
        return f"numpy (REDRAFT_JIT=0; numba {numba.__version__} installed)"
    return f"numba {numba.__version__}" if ENABLED else "numpy (compiled kernels turned off)"


def _njit(fn):
    if numba is None:  # pragma: no cover
        return fn
    return numba.njit(cache=True, nogil=True)(fn)


# ------------------------------------------------------------------------------------ the tree


@_njit
def _tree_nodes(paths, values, budget, has_budget, neg):
    """Per row: which path entries make nodes, which are kept, and their node ids.

    ``rep[b, p, l]``: the first path sharing entry (p, l)'s prefix through depth l (itself for a
    new node); ``keep``: the entry survives the budget (and is a token); ``nid``: the node id of
    each kept new entry (1, 2, ... in path-major order), else 0; ``num_nodes [B]`` (root
    included); ``num_entries [B]``: the entries holding a token (before the budget)."""
    B, P, L = paths.shape
    rep = np.zeros((B, P, L), np.int64)
    keep = np.zeros((B, P, L), np.bool_)
    nid = np.zeros((B, P, L), np.int64)
    num_nodes = np.ones(B, np.int64)
    num_entries = np.zeros(B, np.int64)
    node_val = np.empty(P * L)
    keep_node = np.empty(P * L, np.bool_)
    for b in range(B):
        # the prefix tree: an entry's node is the first path sharing its prefix
        for p in range(P):
            for lv in range(L):
                t = paths[b, p, lv]
                if t < 0:
                    break  # every token after a path's first PAD is PAD
                num_entries[b] += 1
                r = p
                lo = rep[b, p, lv - 1] if lv > 0 else 0  # a sharer shares the shorter prefix too
                for j in range(lo, p):
                    if paths[b, j, lv] == t and (
                        lv == 0 or (keep[b, j, lv - 1] and rep[b, j, lv - 1] == rep[b, p, lv - 1])
                    ):
                        r = j
                        break
                rep[b, p, lv] = r
                keep[b, p, lv] = True
        if has_budget:
            # a node's value: the largest of its entries' (never below neg); entries that are not
            # new nodes rank at neg. The first budget[b] in the order (value descending, earlier
            # entries first among equals) are kept: the new nodes above neg sorted, then every
            # entry at neg in entry order, as tree.build_tree's stable sort has them.
            node_val[:] = neg
            keep_node[:] = False
            for p in range(P):
                for lv in range(L):
                    if not keep[b, p, lv]:
                        break
                    i = rep[b, p, lv] * L + lv
                    v = values[b, p, lv]
                    if v > node_val[i]:
                        node_val[i] = v
            n_above = 0
            for i in range(P * L):
                if node_val[i] > neg:
                    n_above += 1
            above = np.empty(n_above, np.int64)
            k = 0
            for i in range(P * L):
                if node_val[i] > neg:
                    above[k] = i
                    k += 1
            order = np.argsort(-node_val[above], kind="mergesort")
            left = budget[b]
            for r in range(min(max(left, 0), n_above)):
                keep_node[above[order[r]]] = True
            left -= n_above
            i = 0
            while left > 0 and i < P * L:
                if node_val[i] <= neg:
                    keep_node[i] = True  # (cleared below unless it is a new node)
                    left -= 1
                i += 1
            for p in range(P):
                for lv in range(L):
                    if not keep[b, p, lv]:
                        break
                    if not keep_node[rep[b, p, lv] * L + lv] or (lv > 0 and not keep[b, p, lv - 1]):
                        keep[b, p, lv] = False
        c = 0
        for p in range(P):
            for lv in range(L):
                if keep[b, p, lv] and rep[b, p, lv] == p:
                    c += 1
                    nid[b, p, lv] = c
        num_nodes[b] = 1 + c
    return rep, keep, nid, num_nodes, num_entries


@_njit
def _tree_fill(paths, rep, keep, nid, num_nodes, N, root, has_root, pad):
    """The packed node arrays of :func:`_tree_nodes`' nodes (those with ids below ``N``)."""
    B, P, L = paths.shape
    tokens = np.full((B, N), pad, np.int64)
    parent = np.zeros((B, N), np.int64)
    depth = np.zeros((B, N), np.int64)
    valid = np.zeros((B, N), np.bool_)
    anc = np.zeros((B, N, N), np.bool_)
    path_node = np.full((B, P, L), -1, np.int64)
    for b in range(B):
        for n in range(N):
            anc[b, n, 0] = True
            anc[b, n, n] = True
            valid[b, n] = n < num_nodes[b]
        parent[b, 0] = -1
        for p in range(P):
            for lv in range(L):
                if not keep[b, p, lv]:
                    break
                path_node[b, p, lv] = nid[b, rep[b, p, lv], lv]
        for p in range(P):
            for lv in range(L):
                if not keep[b, p, lv]:
                    break
                n = nid[b, p, lv]
                if n == 0 or n >= N:
                    continue
                depth[b, n] = lv + 1
                tokens[b, n] = paths[b, p, lv]
                for a in range(lv):  # its ancestors: the nodes on its first path above it
                    anc[b, n, path_node[b, p, a]] = True
                if lv > 0:
                    parent[b, n] = path_node[b, p, lv - 1]
        if N > 0:  # (the root's token, or PAD)
            tokens[b, 0] = root[b] if has_root else pad
    return tokens, parent, depth, valid, anc, path_node


def build_tree(paths: np.ndarray, values, budget, root, size):
    """``hosttree.build_tree_np`` for ``P, L >= 1`` (the caller handles empty paths):
    ``(tokens, parent, depth, valid, anc, path_node, num_nodes, num_entries)``."""
    B = paths.shape[0]
    has_budget = budget is not None
    if has_budget:
        v = np.asarray(values)
        if v.dtype.kind != "f":
            v = v.astype(np.float32)
        neg = float(np.finfo(v.dtype).min)
        if isinstance(budget, (int, np.integer)):
            bud = np.full(B, int(budget), np.int64)  # (a third of broadcast_to's time)
        else:
            bud = np.ascontiguousarray(
                np.broadcast_to(np.asarray(budget, np.int64).reshape(-1), (B,))
            )
    else:
        v, neg, bud = _NO_VALUES, 0.0, _NO_BUDGET[:B]
    rep, keep, nid, num_nodes, num_entries = _tree_nodes(paths, v, bud, has_budget, neg)
    N = size if size is not None else (int(num_nodes.max()) if B else 1)
    has_root = root is not None
    r = np.asarray(root, np.int64).reshape(-1) if has_root else _NO_BUDGET[:B]
    if has_root and r.shape[0] != B:
        r = np.ascontiguousarray(np.broadcast_to(r, (B,)))
    out = _tree_fill(paths, rep, keep, nid, num_nodes, N, r, has_root, PAD)
    return (*out, num_nodes, num_entries)


_NO_VALUES = np.zeros((0, 0, 0), np.float32)
_NO_BUDGET = np.zeros(1 << 16, np.int64)


# --------------------------------------------------------------------------- context matching


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


# ------------------------------------------------------------------------- after the step


@_njit
def _walk(tokens, parent, depth, valid, anc, pick, ok_extra, has_extra, bonus_src, D):
    """``accept.walk``: the deepest node whose path the rule accepts (ties: the lower index);
    ``pick [B, N]`` the token followed after each node, ``ok_extra`` (typical) nodes that pass
    on their own, ``bonus_src`` the token after each node that the step emits last."""
    B, N = tokens.shape
    path = np.full((B, D), -1, np.int64)
    num = np.zeros(B, np.int64)
    last = np.zeros(B, np.int64)
    bonus = np.zeros(B, bonus_src.dtype)
    out = np.zeros((B, D), np.int64)  # the emitted tokens, then the bonus
    ok = np.empty(N, np.bool_)
    for b in range(B):
        for n in range(N):
            o = n == 0 or tokens[b, n] == pick[b, max(parent[b, n], 0)]
            if has_extra and ok_extra[b, n] != 0:
                o = True
            ok[n] = o and valid[b, n]
        best, score = 0, -1  # (the root is always valid and accepted)
        for n in range(N):
            if not valid[b, n]:
                continue
            full = True
            for m in range(N):
                if anc[b, n, m] and not ok[m]:
                    full = False
                    break
            if full:
                s = depth[b, n] * N + (N - 1 - n)
                if s > score:
                    best, score = n, s
        last[b] = best
        num[b] = depth[b, best]
        bonus[b] = bonus_src[b, best]
        for m in range(N):  # the accepted path: the best node's ancestors and itself
            if anc[b, best, m]:
                path[b, depth[b, m]] = m
        for i in range(num[b]):
            out[b, i] = tokens[b, max(path[b, i + 1], 0)]
        out[b, num[b]] = bonus_src[b, best]
    return path, num, last, bonus, out


def walk(rule: str, tree, choices: np.ndarray):
    """``accept.walk``'s fields: ``(path, num_accepted, last_node, bonus, emitted)``."""
    typical = rule == "typical"
    pick = choices[1] if typical else choices[0]
    extra = choices[0] if typical else pick
    D = int(tree.max_depth) + 1
    path, num, last, bonus, out = _walk(
        tree.tokens,
        tree.parent,
        tree.depth,
        tree.valid,
        tree.anc,
        pick,
        extra,
        typical,
        choices[2] if typical else pick,
        D,
    )
    emitted = [r[: n + 1] for r, n in zip(out.tolist(), num.tolist())]
    return path, num, last, bonus, emitted


@_njit
def _feedback(path_node, path, owner, nd, N):
    """``hosttree.hit_np``, ``credit_np`` and ``accepted_prefix_np`` in one pass."""
    B, P, L = path_node.shape
    hit = np.zeros((B, P, L), np.bool_)
    credit = np.zeros((B, nd), np.int64)
    prefix = np.zeros((B, P), np.int64)
    on = np.zeros(N, np.bool_)
    mark = np.zeros((nd, N), np.bool_)
    for b in range(B):
        on[:] = False
        for i in range(path.shape[1]):
            if 0 <= path[b, i] < N:
                on[path[b, i]] = True
        mark[:, :] = False
        for p in range(P):
            run = True
            for lv in range(L):
                n = path_node[b, p, lv]
                h = 0 <= n < N and on[n]
                hit[b, p, lv] = h
                if h:
                    if nd:
                        mark[owner[p], n] = True
                    if run:
                        prefix[b, p] += 1
                else:
                    run = False
        for d in range(nd):
            c = 0
            for n in range(1, N):
                c += mark[d, n]
            credit[b, d] = c
    return hit, credit, prefix


def feedback(tree, path, owner, num_drafters: int):
    """``(hit [B, P, L], credit [B, drafters], prefix [B, P])`` of the step."""
    return _feedback(
        tree.path_node,
        np.asarray(path, np.int64),
        owners(owner, tree.path_node.shape[1]),
        num_drafters,
        tree.tokens.shape[1],
    )


def owners(owner, P: int) -> np.ndarray:
    """``[P]`` int64 the drafter of every path (``owner``: an int or ``[P]``)."""
    o = np.asarray(owner, dtype=np.int64)
    return o if o.ndim == 1 else np.full(P, int(o), np.int64)


# ------------------------------------------------------------------------- statistics


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
    """``hostdraft.best_budget_np`` past its checks: the K in 0..M whose expected tokens per
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


# ------------------------------------------------------------------------- ReDrafter's beams


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
