"""ADED's draft maker: Monte Carlo tree search over a tri-gram table, vectorised in waves.

The search runs from the last two tokens ``(w1, w2)`` of every row. A node is a token; its
children are the table's top-``k`` successors of ``(parent token, node token)``. Each iteration

1. **selects** a path from the root by ``PUCT(s,a) = Q(s,a) + E * P(s,a) * sqrt(sum_b N(s,b)) /
   (1 + N(s,a))`` with ``E = C1 + log((sum_b N(s,b) + C2 + 1) / C2)`` (ADED, Liu et al. 2024);
2. **expands** the first unexpanded node with the table's successors (``P`` = their table
   probabilities) and steps into one child by the same rule;
3. **simulates** to depth ``D`` by sampling the table;
4. **backpropagates** the path score to every node on the path: ``N += 1``, ``W += score``.

The path score of tokens ``x_1..x_D`` with table probabilities ``p_1..p_D`` is the expected number
of tokens the target accepts if it followed the table, ``sum_k prod_{i<=k} p_i``, divided by ``D``
so that ``Q = W / N`` lies in ``[0, 1]``. Candidates are the leaves of the built tree (the
children an expansion created carry their table probabilities even before a visit), ranked by
their path probability ``prod P`` and completed to depth ``D`` with the table's most likely
successor.

Why waves: 150 sequential iterations of a few numpy calls each cost ~10 ms in Python, more than
the verify step they are meant to save on this CPU. So ``B`` iterations run at once per wave (for
every row of the batch at once). Traversals that meet at the same node are spread over its
children as sequential PUCT with virtual visits would spread them: child ``a``'s score for its
``j``-th extra visit this wave is ``Q_a + E * P_a * sqrt(n) / (1 + N_a + j)``, which falls with
``j``, so ``m`` sequential picks are the ``m`` largest scores of the union ``{(a, j)}``, one
``argsort`` (tree parallelisation with virtual visits; the exploration factor is held at its
value at the start of the wave). ``iterations // B`` waves then cost a fixed few hundred numpy
calls, independent of the batch size.

Everything here is plain numpy on the host: the table lookups are ``searchsorted`` on sorted
context keys, and the node arrays are preallocated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# lookup(rows [N], w1 [N], w2 [N], k) -> (ids [N, k] int64 (-1 padded), probs [N, k] float32),
# successors sorted by probability, descending. ``rows`` lets per-request overlays answer.
Lookup = Callable[[np.ndarray, np.ndarray, np.ndarray, int], "tuple[np.ndarray, np.ndarray]"]


@dataclass
class MCTSConfig:
    """Search settings; defaults are the ADED paper's.

    Attributes:
        iterations: MCTS iterations per row and decode step.
        c1, c2: the exploration constants of ``E = C1 + log((sum N + C2 + 1) / C2)``.
        depth: tokens per candidate path (``D``).
        candidates: paths returned per row.
        top_k: successors per node (the table's top-k).
        wave: iterations run at once (see the module doc); 1 = strictly sequential MCTS.
        complete: extend candidates shorter than ``depth`` with the table's most likely successor.
    """

    iterations: int = 150
    c1: float = 32.0
    c2: float = 8.0
    depth: int = 4
    candidates: int = 24
    top_k: int = 12
    wave: int = 50
    complete: bool = True


@dataclass
class MCTSResult:
    """Candidate paths per row.

    Attributes:
        tokens: ``[R, C, D]`` int64, ``-1`` padded (rows with fewer candidates, short paths).
        logp: ``[R, C, D]`` float32: log table probability of each token given its path.
        scores: ``[R, C]`` float32: log path probability in the tree before completion, the
            ranking key (descending); ``-inf`` for missing candidates.
        num_nodes: nodes the search created (all rows).
    """

    tokens: np.ndarray
    logp: np.ndarray
    scores: np.ndarray
    num_nodes: int


def puct_exploration(sum_n: np.ndarray, c1: float, c2: float) -> np.ndarray:
    """``E = C1 + log((sum_b N(s,b) + C2 + 1) / C2)`` (the paper's exploration weight)."""
    return c1 + np.log((sum_n + c2 + 1.0) / c2)


class _Tree:
    """Preallocated node arrays for the roots of all rows (one search)."""

    def __init__(self, capacity: int):
        self.tok = np.full(capacity, -1, np.int64)  # token of the node
        self.prev = np.full(capacity, -1, np.int64)  # token before it (context = (prev, tok))
        self.parent = np.full(capacity, -1, np.int64)
        self.depth = np.zeros(capacity, np.int64)
        self.row = np.zeros(capacity, np.int64)
        self.first_child = np.full(capacity, -1, np.int64)  # -1: not expanded
        self.nchild = np.zeros(capacity, np.int64)
        self.P = np.zeros(capacity, np.float64)  # table probability given the parent's context
        self.pp = np.ones(capacity, np.float64)  # prod of P along the path from the root
        self.ea = np.zeros(capacity, np.float64)  # sum over path prefixes of pp (expected accepted)
        self.N = np.zeros(capacity, np.float64)
        self.W = np.zeros(capacity, np.float64)
        self.size = 0


def _group_ranks(nodes: np.ndarray):
    """Group equal node ids: (unique ids [G], inverse [T], counts [G], rank within group [T])."""
    T = nodes.size
    order = np.argsort(nodes, kind="stable")
    sn = nodes[order]
    new = np.empty(T, bool)
    new[0] = True
    np.not_equal(sn[1:], sn[:-1], out=new[1:])
    starts = np.flatnonzero(new)  # [G] first sorted position of each group
    gid = np.cumsum(new) - 1  # [T] group of each sorted position
    inv = np.empty(T, np.int64)
    inv[order] = gid
    rank = np.empty(T, np.int64)
    rank[order] = np.arange(T) - starts[gid]
    counts = np.diff(np.append(starts, T))
    return sn[starts], inv, counts, rank


def _select_children(tree: _Tree, nodes: np.ndarray, cfg: MCTSConfig) -> np.ndarray:
    """PUCT choice of a child for each traversal at ``nodes`` [T] (expanded, >= 1 child).

    Traversals at the same node take the largest scores of ``{(a, j)}`` in order (virtual
    visits ``j``), so they spread over the children as sequential PUCT would.
    """
    K = cfg.top_k
    uniq, inv, counts, rank = _group_ranks(nodes)
    J = int(counts.max())
    fc, nc = tree.first_child[uniq], tree.nchild[uniq]  # [G]
    slot = np.arange(K)
    valid = slot[None, :] < nc[:, None]  # [G, K]
    kid = np.where(valid, fc[:, None] + slot[None, :], 0)  # [G, K] node ids
    Nc, Wc, Pc = tree.N[kid], tree.W[kid], tree.P[kid]  # [G, K]
    sum_n = (Nc * valid).sum(1)  # [G]
    E = puct_exploration(sum_n, cfg.c1, cfg.c2)
    Q = np.where(Nc > 0, Wc / np.maximum(Nc, 1.0), 0.0)  # [G, K]
    # sqrt of the visits including this wave's (virtual) ones, so a fresh node spreads by P
    explo = (E * np.sqrt(sum_n + counts))[:, None, None] * Pc[:, :, None]  # [G, K, 1]
    S = Q[:, :, None] + explo / (1.0 + Nc[:, :, None] + np.arange(J)[None, None, :])  # [G, K, J]
    S = np.where(valid[:, :, None], S, -np.inf).reshape(len(uniq), K * J)
    if J == 1:
        pick = S.argmax(1)[inv]  # [T]
    else:
        top = np.argsort(-S, axis=1, kind="stable")[:, :J]  # [G, J] flat (a, j) indices
        pick = top[inv, rank] // J
    return fc[inv] + pick


def _expand(tree: _Tree, nodes: np.ndarray, lookup: Lookup, cfg: MCTSConfig) -> None:
    """Give each node of ``nodes`` (unique, unexpanded) its table successors as children."""
    ids, probs = lookup(tree.row[nodes], tree.prev[nodes], tree.tok[nodes], cfg.top_k)  # [G, K]
    valid = ids >= 0
    nc = valid.sum(1)  # successors are left-packed
    start = tree.size + np.cumsum(nc) - nc  # [G] first child of each node
    n_new = int(nc.sum())
    if tree.size + n_new > tree.tok.size:
        raise RuntimeError("MCTS node capacity exceeded")  # capacity is iterations * top_k: a bug
    tree.first_child[nodes] = start
    tree.nchild[nodes] = nc
    g, s = np.nonzero(valid)  # row-major: node by node, successor by successor
    new = start[g] + s
    par = nodes[g]
    tree.tok[new] = ids[g, s]
    tree.prev[new] = tree.tok[par]
    tree.parent[new] = par
    tree.depth[new] = tree.depth[par] + 1
    tree.row[new] = tree.row[par]
    p = probs[g, s].astype(np.float64)
    tree.P[new] = p
    tree.pp[new] = tree.pp[par] * p
    tree.ea[new] = tree.ea[par] + tree.pp[new]
    tree.size += n_new


def _rollout(
    tree: _Tree, nodes: np.ndarray, lookup: Lookup, cfg: MCTSConfig, rng: np.random.Generator
) -> np.ndarray:
    """Score of each traversal ending at ``nodes`` [T]: its tree path, then table samples to
    depth ``D`` (a context the table does not know ends the rollout). Returns ``[T]`` in [0, 1]."""
    value = tree.ea[nodes].copy()  # [T] expected accepted tokens along the tree path
    pp = tree.pp[nodes].copy()  # [T] probability of the path so far
    rows, w1, w2 = tree.row[nodes], tree.prev[nodes].copy(), tree.tok[nodes].copy()
    depth = tree.depth[nodes].copy()
    while True:
        idx = np.nonzero((depth < cfg.depth) & (w2 >= 0))[0]
        if idx.size == 0:
            break
        ids, probs = lookup(rows[idx], w1[idx], w2[idx], cfg.top_k)  # [n, K]
        cum = np.cumsum(probs, axis=1)  # [n, K]: sample among the listed successors
        u = rng.random(idx.size) * cum[:, -1]
        j = np.minimum((u[:, None] >= cum).sum(1), cfg.top_k - 1)
        ar = np.arange(idx.size)
        tok, p = ids[ar, j], probs[ar, j].astype(np.float64)
        pp[idx] *= np.where(tok >= 0, p, 0.0)
        value[idx] += pp[idx]
        w1[idx], w2[idx] = w2[idx], tok
        depth[idx] += 1
    return value / cfg.depth


def mcts_search(
    root_w1: np.ndarray,
    root_w2: np.ndarray,
    lookup: Lookup,
    cfg: MCTSConfig | None = None,
    rng: np.random.Generator | None = None,
) -> MCTSResult:
    """Run ADED's MCTS from ``(w1, w2)`` of every row and return ranked candidate paths.

    Args:
        root_w1, root_w2: ``[R]`` int: the last two tokens of each row (``-1``: none; the row
            then gets no candidates unless the lookup answers for it).
        lookup: the tri-gram successors (see :data:`Lookup`), per row.
        cfg: search settings (paper defaults).
        rng: random generator for the simulations (seed it for reproducible drafts).

    Returns:
        :class:`MCTSResult` with ``[R, candidates, depth]`` paths ranked by score.
    """
    cfg = cfg or MCTSConfig()
    rng = rng or np.random.default_rng(0)
    root_w1 = np.asarray(root_w1, np.int64)
    root_w2 = np.asarray(root_w2, np.int64)
    R, D, B = root_w2.size, cfg.depth, max(1, min(cfg.wave, cfg.iterations))
    n_waves = -(-cfg.iterations // B)
    tree = _Tree(R * (1 + n_waves * B * cfg.top_k) + 1)
    roots = np.arange(R)
    tree.tok[roots], tree.prev[roots], tree.row[roots] = root_w2, root_w1, roots
    tree.size = R
    for _ in range(n_waves):
        cur = np.repeat(roots, B)  # [T] traversals, T = R * B
        path = np.full((cur.size, D + 1), -1, np.int64)  # node at each depth
        path[:, 0] = cur
        for level in range(D):
            move = (tree.first_child[cur] >= 0) & (tree.nchild[cur] > 0)
            idx = np.nonzero(move)[0]
            if idx.size == 0:
                break
            cur[idx] = _select_children(tree, cur[idx], cfg)
            path[idx, level + 1] = cur[idx]
        fresh = (tree.first_child[cur] < 0) & (tree.depth[cur] < D)
        if fresh.any():
            fn = np.sort(cur[fresh])
            _expand(tree, fn[np.append(True, fn[1:] != fn[:-1])], lookup, cfg)  # unique nodes
            idx = np.nonzero(fresh & (tree.nchild[cur] > 0))[0]
            if idx.size:
                cur[idx] = _select_children(tree, cur[idx], cfg)
                path[idx, tree.depth[cur[idx]]] = cur[idx]
        value = _rollout(tree, cur, lookup, cfg, rng)  # [T]
        on = path >= 0
        np.add.at(tree.N, path[on], 1.0)
        np.add.at(tree.W, path[on], np.broadcast_to(value[:, None], path.shape)[on])
    return _candidates(tree, R, lookup, cfg)


def _top_per_row(row: np.ndarray, score: np.ndarray, R: int, C: int):
    """Indices (into ``row``) of the ``C`` best scores of every row, and their rank in the row."""
    order = np.lexsort((-score, row))
    counts = np.bincount(row, minlength=R)
    rank = np.arange(row.size) - (np.cumsum(counts) - counts)[row[order]]
    keep = rank < C
    return order[keep], rank[keep]


def _candidates(tree: _Tree, R: int, lookup: Lookup, cfg: MCTSConfig) -> MCTSResult:
    """The ``C`` most probable leaves of the built tree per row, completed greedily to depth D.

    Leaves are all created nodes without children (the children an expansion created carry
    their table probability even before a visit). Ranking by path probability ``prod P`` makes
    the union of the candidates the most probable nodes the search found, which is what a tree
    verifier accepts most of (ranking by the summed score instead picks deep paths that share
    their first tokens: on a 400-token Markov table, 1.65 vs 2.76 expected accepted tokens).
    """
    n, D, C = tree.size, cfg.depth, cfg.candidates
    leaf = np.nonzero(tree.nchild[:n] == 0)[0]
    leaf = leaf[leaf >= R]  # roots are not candidates
    sel, rank = _top_per_row(tree.row[leaf], tree.pp[leaf], R, C)
    leaf = leaf[sel]
    M = leaf.size
    lrow = tree.row[leaf]
    tokens = np.full((M, D), -1, np.int64)
    logp = np.zeros((M, D), np.float32)
    node = leaf.copy()  # walk up the tree: D gathers
    ar = np.arange(M)
    for _ in range(D):
        ok = node >= R  # not a root
        at = ar[ok]
        d = tree.depth[node[at]] - 1
        tokens[at, d] = tree.tok[node[at]]
        logp[at, d] = np.log(np.maximum(tree.P[node[at]], 1e-30))
        node = np.where(ok, tree.parent[node], node)
    if cfg.complete and M:
        dep = tree.depth[leaf]
        w1, w2 = tree.prev[leaf].copy(), tree.tok[leaf].copy()
        for d in range(int(dep.min()), D):
            at = np.nonzero((dep <= d) & (w2 >= 0))[0]
            if at.size == 0:
                continue
            ids, probs = lookup(lrow[at], w1[at], w2[at], 1)
            tok = ids[:, 0]
            tokens[at, d] = tok
            logp[at, d] = np.where(tok >= 0, np.log(np.maximum(probs[:, 0], 1e-30)), 0.0)
            w1[at], w2[at] = w2[at], tok  # a dead end (-1) leaves the path short
    out_t = np.full((R, C, D), -1, np.int64)
    out_l = np.zeros((R, C, D), np.float32)
    out_s = np.full((R, C), -np.inf, np.float32)
    out_t[lrow, rank] = tokens
    out_l[lrow, rank] = logp
    out_s[lrow, rank] = np.log(np.maximum(tree.pp[leaf], 1e-300))
    return MCTSResult(tokens=out_t, logp=out_l, scores=out_s, num_nodes=tree.size)
