"""The tree's kernels: the tree built from the drafters' paths, the accepted path walked in it,
and what each path and drafter got from the step (``hosttree`` and ``accept.walk`` compiled)."""

from __future__ import annotations

import numpy as np

from redraft.infer.spec.hostjit.njit import _njit
from redraft.infer.spec.paths import PAD


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
