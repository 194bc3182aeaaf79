"""One draft tree from the paths of all drafters, with shared prefixes stored once: the torch
version, kept as the oracle of the decoder's numpy and numba tree
(``redraft.infer.spec.hosttree.build_tree_np``, ``redraft.infer.spec.hostjit.build_tree``).

Idea (Apple's "dynamic tree attention", generalised to paths of different lengths)
----------------------------------------------------------------------------------
Paths ``[B, P, L]`` (``-1`` after a path ends). Two entries ``(i, l)`` and ``(j, l)`` are the
same tree node iff paths ``i`` and ``j`` agree on every token ``0..l``::

    eq[b, i, j, l]   = paths[b, i, l] == paths[b, j, l]   (both valid)
    same[b, i, j, l] = cumprod(eq, over l)                (all tokens up to l agree)
    rep[b, i, l]     = argmax_j same[b, i, j, l]          (the smallest path sharing the prefix)

An entry is a *new* node iff ``rep == i``. Worked example, one row, three paths::

    path 0: a b c          rep: 0 0 0     new: 1 1 1    node ids 1 2 3
    path 1: a b d          rep: 0 0 1     new: 0 0 1    node ids 1 2 4
    path 2: e -  -         rep: 2 . .     new: 1 0 0    node ids 5

Nodes are numbered in (path, depth) order, so a parent always precedes its child; node 0 is the
root, the token the target produced last (``y``), which every node attends to. The ancestor
matrix ``anc[b, n, m]`` (m is n or an ancestor of n) is the attention mask inside the tree;
the decoder puts it after the cache columns. Position ids are ``cache length + depth``.
Everything is tensor ops over ``B x P x P x L``: no Python loop over tokens or paths.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from redraft.infer.spec.paths import PAD, cached_arange, clean_paths


@dataclass
class Tree:
    """A packed draft tree per batch row (node 0 = root = the last token ``y``).

    Attributes:
        tokens: ``[B, N]`` long node tokens (root: the ``root`` given to :func:`build_tree`, else
            ``PAD``); padding nodes are ``PAD``.
        parent: ``[B, N]`` long parent node (root and padding: 0; root's own parent is -1).
        depth: ``[B, N]`` long (root 0, a path's token ``l`` has depth ``l+1``).
        valid: ``[B, N]`` bool real nodes (root included).
        anc: ``[B, N, N]`` bool, ``anc[b, n, m]``: node m is n itself or an ancestor of n.
        path_node: ``[B, P, L]`` long node of every path entry, -1 where the path has ended or
            the entry was pruned.
        num_nodes: ``[B]`` long real nodes per row, root included.
        num_entries: ``[B]`` long path tokens per row before pruning and sharing.
        max_depth: ``L``, the deepest a node can be (a host int: shapes never need a device read).
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    anc: torch.Tensor
    path_node: torch.Tensor
    num_nodes: torch.Tensor
    num_entries: torch.Tensor
    max_depth: int = 0

    @property
    def size(self) -> int:
        """Nodes per row in the packed tensors (root included): what one verify forward costs."""
        return int(self.tokens.shape[1])


def dedup_paths(
    paths: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Find shared prefixes. ``paths [B, P, L]`` -> ``(valid, rep, is_new)`` all ``[B, P, L]``.

    ``rep[b, i, l]`` is the smallest path index whose first ``l+1`` tokens equal path ``i``'s.
    """
    B, P, L = paths.shape
    valid = paths >= 0 if valid is None else valid
    eq = (paths[:, :, None, :] == paths[:, None, :, :]) & valid[:, :, None, :]  # [B, P, P, L]
    same = eq.to(torch.int8).cumprod(dim=-1).bool()  # prefix 0..l agrees
    rep = same.to(torch.int8).argmax(dim=2)  # [B, P, L] first True along j (i itself is True)
    is_new = valid & (rep == cached_arange(P, paths.device)[None, :, None])
    return valid, rep, is_new


def _kept_entries(valid, rep, is_new, values: torch.Tensor, budget) -> torch.Tensor:
    """``[B, P, L]`` bool: entries of the ``budget`` most valuable nodes per row, prefix-closed.

    A node's value is the max over the entries that share it; nodes are ranked by value (stable:
    earlier paths win ties). Values must not increase along a path, so the kept set is a tree.
    """
    B, P, L = valid.shape
    dev = valid.device
    neg = torch.finfo(values.dtype).min
    flat_val = torch.where(valid, values, neg).reshape(B, P * L)
    rep_flat = (rep * L + cached_arange(L, dev)).reshape(B, P * L)
    node_val = torch.full_like(flat_val, neg).scatter_reduce(1, rep_flat, flat_val, reduce="amax")
    node_val = torch.where(is_new.reshape(B, -1), node_val, neg)
    order = torch.sort(node_val, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, cached_arange(P * L, dev).expand(B, -1))
    budget = (
        torch.as_tensor(budget, device=dev).reshape(-1, 1)
        if not isinstance(budget, int)
        else budget
    )
    keep_node = (rank < budget) & is_new.reshape(B, -1)
    keep = keep_node.gather(1, rep_flat).reshape(B, P, L) & valid
    return (
        keep.to(torch.int8).cumprod(dim=-1).bool()
    )  # an entry stays only if its whole prefix does


def build_tree(
    paths: torch.Tensor,
    values: torch.Tensor | None = None,
    budget: torch.Tensor | int | None = None,
    root: torch.Tensor | None = None,
    size: int | None = None,
    clean: bool = True,
) -> Tree:
    """Merge candidate paths into one :class:`Tree`, keeping the ``budget`` best nodes per row.

    Args:
        paths: ``[B, P, L]`` long candidate paths (``PAD`` after a path's end).
        values: ``[B, P, L]`` value of each entry (e.g. its estimated probability of being
            accepted), non-increasing along a path; needed with ``budget``.
        budget: int or ``[B]`` long: nodes to keep per row besides the root (``None``: all).
        root: ``[B]`` long token of node 0 (the last token the target produced).
        size: nodes per row in the packed tensors (root included). ``None``: the largest row's
            node count (one device read); a fixed size (>= 1 + budget) keeps shapes static for a
            captured verify forward, the extra nodes being padding.
        clean: make every token after a path's first ``PAD`` a ``PAD`` first (``False`` when the
            caller already did: the decoder cleans each drafter's paths once).
    """
    if clean:
        paths = clean_paths(paths)
    B, P, L = paths.shape
    dev = paths.device
    valid = paths >= 0
    num_entries = valid.sum(dim=(1, 2))
    if P == 0 or L == 0:  # no drafts: the root alone (plain autoregressive step)
        N = size or 1
        z = torch.zeros((B, N), dtype=torch.long, device=dev)
        tokens = z - 1 if root is None else torch.cat([root[:, None], z[:, 1:] - 1], dim=1)
        node_valid = torch.zeros((B, N), dtype=torch.bool, device=dev)
        node_valid[:, 0] = True
        anc = _eye(N, dev).expand(B, N, N).clone()
        anc[:, :, 0] = True
        parent = z.clone()
        parent[:, 0] = -1
        return Tree(
            tokens=tokens,
            parent=parent,
            depth=z,
            valid=node_valid,
            anc=anc,
            path_node=paths.new_full((B, P, L), -1),
            num_nodes=z[:, 0] + 1,
            num_entries=num_entries,
            max_depth=0,
        )
    valid, rep, is_new = dedup_paths(paths, valid)
    if budget is not None:
        keep = _kept_entries(valid, rep, is_new, values, budget)
        valid, is_new = keep, is_new & keep
    flat_new = is_new.reshape(B, P * L)
    # node id of each new entry: 1 + how many new entries precede it in (path, depth) order
    nid_flat = flat_new.long().cumsum(dim=1) * flat_new  # [B, P*L], 0 for non-new
    num_nodes = 1 + flat_new.sum(dim=1)  # [B]
    N = size if size is not None else (int(num_nodes.max()) if B else 1)
    # every entry's node = the node of (its representative path, same depth)
    path_node = nid_flat.gather(1, (rep * L + cached_arange(L, dev)).reshape(B, P * L)).reshape(
        B, P, L
    )
    path_node = torch.where(valid, path_node, -1)
    # per node: the path it was first seen on and its depth (new entries write, the rest go to
    # slot 0, the root, which is overwritten; a too-small fixed size drops into the spare slot N)
    slot = nid_flat.clamp(max=N)
    node_path = torch.zeros((B, N + 1), dtype=torch.long, device=dev).scatter_(
        1, slot, _entry_path(P, L, dev).expand(B, -1)
    )[:, :N]
    depth = torch.zeros((B, N + 1), dtype=torch.long, device=dev).scatter_(
        1, slot, flat_new * _entry_depth(P, L, dev)
    )[:, :N]
    depth[:, 0] = 0
    # a node's ancestors are the nodes on its first path above it: one gather of that path
    on_path = path_node.gather(1, node_path[:, :, None].expand(B, N, L))  # [B, N, L]
    upto = (
        cached_arange(L, dev) < depth[:, :, None]
    )  # entries 0..depth-1: the ancestors and the node itself
    anc = torch.zeros((B, N, N + 1), dtype=torch.bool, device=dev).scatter_(
        2, torch.where(upto, on_path, N), True
    )[:, :, :N]
    anc[:, :, 0] = True
    anc |= _eye(N, dev)
    parent = torch.where(
        depth > 1, on_path.gather(2, (depth - 2).clamp_min(0)[:, :, None])[:, :, 0], 0
    )
    parent[:, 0] = -1
    tokens = paths.gather(1, node_path[:, :, None].expand(B, N, L)).gather(
        2, (depth - 1).clamp_min(0)[:, :, None]
    )[:, :, 0]
    node_valid = cached_arange(N, dev)[None, :] < num_nodes[:, None]
    tokens = torch.where(node_valid, tokens, PAD)
    tokens[:, 0] = PAD if root is None else root
    return Tree(
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


@functools.lru_cache(maxsize=64)
def _eye(n: int, device) -> torch.Tensor:
    return torch.eye(n, dtype=torch.bool, device=device)


@functools.lru_cache(maxsize=256)
def _entry_path(P: int, L: int, device) -> torch.Tensor:
    """``[1, P*L]``: the path index of every flat entry."""
    return torch.arange(P, device=device).repeat_interleave(L)[None]


@functools.lru_cache(maxsize=256)
def _entry_depth(P: int, L: int, device) -> torch.Tensor:
    """``[1, P*L]``: the depth (1-based) of every flat entry."""
    return (torch.arange(L, device=device) + 1).repeat(P)[None]


def prune_paths(
    paths: torch.Tensor, values: torch.Tensor, budget: torch.Tensor | int
) -> torch.Tensor:
    """The paths with every entry :func:`build_tree` would drop for ``budget`` set to ``PAD``
    (for inspection and tests; the decoder prunes inside ``build_tree``)."""
    paths = clean_paths(paths)
    valid, rep, is_new = dedup_paths(paths)
    return paths.masked_fill(~_kept_entries(valid, rep, is_new, values, budget), PAD)
