"""The draft tree built on the host (numpy): one tree per step from every drafter's paths.

:func:`build_tree_np` is ``build_tree`` of the tests' torch reference (tests/reference/tree.py)
in numpy, with the same node numbering, pruning, ties and padding; that module's doc explains
the idea with a worked example. The engine uploads the fields the device needs in the one
step-input format (``redraft.infer.runner.step_input.StepInput``: cache lengths, tokens, depth,
parent, ancestors in one int64 tensor).

The host keeps the :class:`HostTree` and does the step's bookkeeping from the accepted path it
reads back (:func:`hit_np`, :func:`credit_np`, :func:`accepted_prefix_np`: the decoder's
``credit`` and ``feedback`` without kernels).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from redraft.infer.spec import hostjit
from redraft.infer.spec.paths import PAD


@dataclass
class HostTree:
    """The packed tree of a step, numpy fields (int64; ``valid`` and ``anc`` bool), the same as
    the tests' torch ``Tree`` (tests/reference/tree.py): ``tokens [B, N]`` node tokens (node 0
    the root), ``parent`` and ``depth`` per node, ``anc [B, N, N]`` ancestor-or-self,
    ``path_node [B, P, L]`` the node of every path entry (``-1``: pruned or padding)."""

    tokens: np.ndarray  # [B, N]
    parent: np.ndarray  # [B, N]
    depth: np.ndarray  # [B, N]
    valid: np.ndarray  # [B, N] bool
    anc: np.ndarray  # [B, N, N] bool
    path_node: np.ndarray  # [B, P, L]
    num_nodes: np.ndarray  # [B]
    num_entries: np.ndarray  # [B]
    max_depth: int = 0

    @property
    def size(self) -> int:
        return int(self.tokens.shape[1])


def clean_paths_np(paths: np.ndarray) -> np.ndarray:
    """Every token after a path's first ``PAD`` (or negative id) made ``PAD`` (``clean_paths``)."""
    return np.where(np.logical_and.accumulate(paths >= 0, axis=-1), paths, PAD)


@functools.lru_cache(maxsize=256)
def _index(*shape: int) -> tuple[np.ndarray, ...]:
    """Read-only ``arange`` s shaped to broadcast along each axis of ``shape`` (made once per
    shape: a numpy call costs about a microsecond, the whole tree a few dozen of them)."""
    out = []
    for axis, n in enumerate(shape):
        a = np.arange(n).reshape([n if i == axis else 1 for i in range(len(shape))])
        a.flags.writeable = False
        out.append(a)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _eye(n: int) -> np.ndarray:
    e = np.eye(n, dtype=bool)
    e.flags.writeable = False
    return e


def dedup_paths_np(paths: np.ndarray, valid: np.ndarray):
    """``tree.dedup_paths``: ``(valid, rep, is_new)`` all ``[B, P, L]``."""
    P = paths.shape[1]
    eq = (paths[:, :, None, :] == paths[:, None, :, :]) & valid[:, :, None, :]  # [B, P, P, L]
    rep = np.logical_and.accumulate(eq, axis=-1).argmax(axis=2)  # first path sharing the prefix
    return valid, rep, valid & (rep == _index(1, P, 1)[1])


def _kept_entries_np(valid, rep, is_new, values: np.ndarray, budget) -> np.ndarray:
    """``tree._kept_entries``: ``[B, P, L]`` bool, the entries of the ``budget`` best nodes."""
    B, P, L = valid.shape
    values = np.asarray(values)
    dtype = values.dtype if values.dtype.kind == "f" else np.float32
    neg = np.finfo(dtype).min
    val = np.where(valid, values, neg).astype(dtype, copy=False)  # [B, P, L]
    # a node's value: the max over the entries sharing it (rep[b, j, l] == i)
    owns = rep[:, None, :, :] == _index(1, P, 1, 1)[1]  # [B, P(i), P(j), L]
    node_val = np.where(owns, val[:, None], neg).max(axis=2)
    node_val = np.where(is_new, node_val, neg).reshape(B, P * L)
    order = np.argsort(-node_val, axis=1, kind="stable")  # descending, earlier entries win ties
    budget = np.asarray(budget).reshape(-1, 1) if not isinstance(budget, int) else budget
    rows, ranks = _index(B, P * L)
    keep_node = np.empty((B, P * L), dtype=bool)
    keep_node[rows, order] = np.broadcast_to(
        ranks < budget, (B, P * L)
    )  # the first `budget` in that order
    keep_node &= is_new.reshape(B, -1)
    keep = (
        keep_node[rows, (rep * L + _index(1, 1, L)[2]).reshape(B, P * L)].reshape(B, P, L) & valid
    )
    return np.logical_and.accumulate(keep, axis=-1)  # an entry stays only if its whole prefix does


@functools.lru_cache(maxsize=64)
def _root_parts(B: int, N: int) -> tuple[np.ndarray, ...]:
    """The parts of a root-only tree that do not depend on the tokens (made once per shape, read
    only: every plain decode step builds one)."""
    parent = np.zeros((B, N), dtype=np.int64)
    parent[:, 0] = -1
    valid = np.zeros((B, N), dtype=bool)
    valid[:, 0] = True
    anc = np.broadcast_to(_eye(N), (B, N, N)).copy()
    anc[:, :, 0] = True
    parts = (parent, np.zeros((B, N), dtype=np.int64), valid, anc, np.ones(B, dtype=np.int64))
    for a in parts:
        a.flags.writeable = False
    return parts


def _root_only(paths, root, size, num_entries) -> HostTree:
    """No drafts: the root alone, padded to ``size``."""
    B, P, L = paths.shape
    N = size or 1
    tokens = np.full((B, N), PAD, dtype=np.int64)
    if root is not None:
        tokens[:, 0] = root
    parent, depth, valid, anc, ones = _root_parts(B, N)
    return HostTree(
        tokens=tokens,
        parent=parent,
        depth=depth,
        valid=valid,
        anc=anc,
        path_node=np.full((B, P, L), -1, dtype=np.int64),
        num_nodes=ones,
        num_entries=num_entries,
        max_depth=0,
    )


def _useful_extent(valid: np.ndarray, budget, P: int, L: int) -> tuple[int, int]:
    """``(paths, depths)`` of ``[B, P, L]`` entries that can make a node: paths past the last
    one holding a token in any row are empty, and with a ``budget`` of K nodes no node deeper
    than K is kept (each of its K or more ancestors is worth at least as much and comes first in
    the order). The deduplication compares every pair of paths at every depth, so a batch of 64
    rows with budgets of 2 nodes paid for 12 depths where 2 can matter. Cut only where the
    pairs shrink by a quarter in a large batch: the second call costs ~15 us."""
    used = np.flatnonzero(valid.any(axis=(0, 2)))
    Pk = int(used[-1]) + 1 if len(used) else 1
    Lk = L
    if budget is not None:
        Lk = min(L, max(int(np.max(budget)), 1))
    return Pk, Lk


def build_tree_np(
    paths, values=None, budget=None, root=None, size: int | None = None, clean: bool = True
) -> HostTree:
    """``tree.build_tree`` on the host: merge ``paths [B, P, L]`` into one :class:`HostTree`,
    keeping the ``budget`` (int or ``[B]``) most valuable nodes per row by ``values [B, P, L]``
    (non-increasing along a path); ``root [B]`` is node 0's token; ``size`` the packed node
    count (``None``: the largest row's). Every field equals ``build_tree``'s."""
    paths = np.asarray(paths, dtype=np.int64)
    B, P, L = paths.shape
    if hostjit.ENABLED and P and L and (budget is None or values is not None):
        # (tokens, parent, depth, valid, anc, path_node, num_nodes, num_entries): field order
        fields = hostjit.build_tree(np.ascontiguousarray(paths), values, budget, root, size)
        return HostTree(*fields, max_depth=L)
    if clean:
        paths = clean_paths_np(paths)
    valid = paths >= 0
    num_entries = valid.sum(axis=(1, 2))
    if P == 0 or L == 0:
        return _root_only(paths, root, size, num_entries)
    Pk, Lk = _useful_extent(valid, budget, P, L) if B * P * P * L >= 8192 else (P, L)
    if 4 * Pk * Pk * Lk <= 3 * P * P * L:  # the same tree from the entries that can be kept
        tree = build_tree_np(
            paths[:, :Pk, :Lk],
            None if values is None else np.asarray(values)[:, :Pk, :Lk],
            budget,
            root,
            size,
            clean=False,
        )
        path_node = np.full((B, P, L), -1, dtype=np.int64)
        path_node[:, :Pk, :Lk] = tree.path_node
        tree.path_node, tree.num_entries, tree.max_depth = path_node, num_entries, L
        return tree
    valid, rep, is_new = dedup_paths_np(paths, valid)
    if budget is not None:
        keep = _kept_entries_np(valid, rep, is_new, values, budget)
        valid, is_new = keep, is_new & keep
    flat_new = is_new.reshape(B, P * L)
    nid_flat = np.cumsum(flat_new, axis=1) * flat_new  # node id of each new entry, 0 elsewhere
    num_nodes = 1 + flat_new.sum(axis=1)
    N = size if size is not None else (int(num_nodes.max()) if B else 1)
    rows, _ = _index(B, P * L)
    path_node = nid_flat[rows, (rep * L + _index(1, 1, L)[2]).reshape(B, P * L)].reshape(B, P, L)
    path_node = np.where(valid, path_node, -1)
    # per node: the path it was first seen on and its depth (nodes past a too-small size dropped)
    bi, ei = np.nonzero(flat_new & (nid_flat < N))
    nid = nid_flat[bi, ei]
    node_path = np.zeros((B, N), dtype=np.int64)
    depth = np.zeros((B, N), dtype=np.int64)
    node_path[bi, nid] = ei // L
    depth[bi, nid] = ei % L + 1
    # a node's ancestors are the nodes on its first path above it (depths 0..depth-1 of it)
    rows3, nodes3, depths3 = _index(B, N, L)
    on_path = path_node[rows3, node_path[:, :, None], depths3]  # [B, N, L]
    anc = np.zeros((B, N, N + 1), dtype=bool)
    anc[rows3, nodes3, np.where(depths3 < depth[:, :, None], on_path, N)] = True
    anc = anc[:, :, :N]
    anc[:, :, 0] = True
    anc |= _eye(N)
    rows2, nodes2 = _index(B, N)
    parent = np.where(depth > 1, on_path[rows2, nodes2, np.maximum(depth - 2, 0)], 0)
    parent[:, 0] = -1
    node_valid = nodes2 < num_nodes[:, None]
    tokens = np.where(node_valid, paths[rows2, node_path, np.maximum(depth - 1, 0)], PAD)
    tokens[:, 0] = PAD if root is None else np.asarray(root, dtype=np.int64)
    return HostTree(
        tokens=tokens,
        parent=parent,
        depth=depth,
        valid=node_valid,
        anc=anc,
        path_node=path_node,
        num_nodes=num_nodes,
        num_entries=num_entries,
        max_depth=L,
    )


# ---------------------------------------------------------------------- after the step


def hit_np(tree: HostTree, path) -> np.ndarray:
    """``[B, P, L]`` bool: path entries whose node lies on the accepted path ``path [B, D+1]``
    (node indices root first, -1 padded, as the device's ``Acceptance.path``)."""
    B, N = tree.tokens.shape
    path = np.asarray(path, dtype=np.int64)
    on_path = np.zeros((B, N + 1), dtype=bool)
    on_path[np.arange(B)[:, None], np.where(path >= 0, path, N)] = True
    pn = tree.path_node
    return (pn >= 0) & np.take_along_axis(
        on_path[:, :N], np.maximum(pn, 0).reshape(B, -1), 1
    ).reshape(pn.shape)


def credit_np(
    tree: HostTree, path, owner, num_drafters: int, hit: np.ndarray | None = None
) -> np.ndarray:
    """``Speculator.feedback``'s credit: ``int64 [B, num_drafters]`` accepted draft
    tokens each drafter proposed (a node several of its paths share counts once; a node several
    drafters proposed counts for each). ``owner [P]``: the drafter of every path."""
    B, N = tree.tokens.shape
    hit = hit_np(tree, path) if hit is None else hit
    if hit.shape[1] == 0 or num_drafters == 0:
        return np.zeros((B, num_drafters), dtype=np.int64)
    mark = np.zeros((B, num_drafters, N), dtype=bool)
    b, p, d = np.nonzero(hit)  # row, path, depth of every hit entry
    mark[b, np.asarray(owner, dtype=np.int64)[p], tree.path_node[b, p, d]] = True
    return mark[:, :, 1:].sum(axis=-1, dtype=np.int64)


def accepted_prefix_np(hit: np.ndarray) -> np.ndarray:
    """``[B, P]`` int64 accepted leading tokens per path (``feedback``'s ``prefix``)."""
    return np.logical_and.accumulate(hit, axis=-1).sum(axis=-1, dtype=np.int64)


def step_feedback_np(tree: HostTree, path, owner, num_drafters: int):
    """``(hit_np, credit_np, accepted_prefix_np)`` of the step, in one pass where compiled."""
    if hostjit.ENABLED:
        return hostjit.feedback(tree, path, owner, num_drafters)
    hit = hit_np(tree, path)
    return hit, credit_np(tree, path, owner, num_drafters, hit=hit), accepted_prefix_np(hit)
