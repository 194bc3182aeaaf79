"""One draft tree from the paths of all drafters, with shared prefixes stored once.

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

from dataclasses import dataclass

import torch

from redraft.infer.drafters.base import PAD, clean_paths


@dataclass
class Tree:
    """A packed draft tree per batch row (node 0 = root = the last token ``y``).

    Attributes:
        tokens: ``[B, N]`` long node tokens (root filled with ``PAD``; the decoder puts ``y``
            there); padding nodes are ``PAD``.
        parent: ``[B, N]`` long parent node (root and padding: 0; root's own parent is -1).
        depth: ``[B, N]`` long (root 0, a path's token ``l`` has depth ``l+1``).
        valid: ``[B, N]`` bool real nodes (root included).
        anc: ``[B, N, N]`` bool, ``anc[b, n, m]``: node m is n itself or an ancestor of n.
        path_node: ``[B, P, L]`` long node of every path entry, -1 where the path has ended.
        num_nodes: ``[B]`` long real nodes per row, root included.
        num_entries: ``[B]`` long path tokens per row before sharing (tree size before dedup).
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    anc: torch.Tensor
    path_node: torch.Tensor
    num_nodes: torch.Tensor
    num_entries: torch.Tensor

    @property
    def size(self) -> int:
        """Nodes per row in the packed tensors (root included): what one verify forward costs."""
        return int(self.tokens.shape[1])


def dedup_paths(paths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Find shared prefixes. ``paths [B, P, L]`` -> ``(valid, rep, is_new)`` all ``[B, P, L]``.

    ``rep[b, i, l]`` is the smallest path index whose first ``l+1`` tokens equal path ``i``'s.
    """
    B, P, L = paths.shape
    valid = paths >= 0
    eq = (paths[:, :, None, :] == paths[:, None, :, :]) & valid[:, :, None, :]  # [B, P, P, L]
    same = eq.to(torch.int8).cumprod(dim=-1).bool()  # prefix 0..l agrees
    rep = same.to(torch.int8).argmax(dim=2)  # [B, P, L] first True along j (i itself is True)
    ar = torch.arange(P, device=paths.device)
    is_new = valid & (rep == ar[None, :, None])
    return valid, rep, is_new


def build_tree(paths: torch.Tensor) -> Tree:
    """Merge candidate paths ``[B, P, L]`` (``PAD`` after a path's end) into one :class:`Tree`."""
    paths = clean_paths(paths)
    B, P, L = paths.shape
    dev = paths.device
    if P == 0:  # no drafts: the root alone (plain autoregressive step)
        z = torch.zeros((B, 1), dtype=torch.long, device=dev)
        return Tree(tokens=z - 1, parent=z - 1, depth=z, valid=torch.ones((B, 1), dtype=torch.bool, device=dev),
                    anc=torch.ones((B, 1, 1), dtype=torch.bool, device=dev), path_node=paths.new_full((B, 0, L), -1),
                    num_nodes=z[:, 0] + 1, num_entries=z[:, 0])
    valid, rep, is_new = dedup_paths(paths)
    flat_new = is_new.reshape(B, P * L)
    # node id of each new entry: 1 + how many new entries precede it in (path, depth) order
    nid_flat = flat_new.long().cumsum(dim=1) * flat_new  # [B, P*L], 0 for non-new
    num_nodes = 1 + flat_new.sum(dim=1)  # [B]
    N = int(num_nodes.max()) if B else 1
    # every entry's node = node of (rep path, same depth)
    depth_idx = torch.arange(L, device=dev)[None, None, :]
    rep_flat = rep * L + depth_idx  # [B, P, L] flat index of the representative entry
    path_node = nid_flat.gather(1, rep_flat.reshape(B, P * L)).reshape(B, P, L)
    path_node = torch.where(valid, path_node, torch.full_like(path_node, -1))

    tokens = torch.full((B, N), PAD, dtype=torch.long, device=dev)
    parent = torch.zeros((B, N), dtype=torch.long, device=dev)
    depth = torch.zeros((B, N), dtype=torch.long, device=dev)
    # scatter new entries into their node slots (non-new entries write into slot 0, then reset)
    slot = nid_flat  # [B, P*L]
    par_entry = torch.cat([torch.zeros_like(path_node[:, :, :1]), path_node[:, :, :-1]], dim=2)
    tokens.scatter_(1, slot, torch.where(flat_new, paths.reshape(B, -1), PAD))
    parent.scatter_(1, slot, torch.where(flat_new, par_entry.reshape(B, -1).clamp_min(0), 0))
    depth.scatter_(1, slot, torch.where(flat_new, (depth_idx + 1).expand(B, P, L).reshape(B, -1), 0))
    tokens[:, 0] = PAD
    parent[:, 0] = -1
    depth[:, 0] = 0
    node_ar = torch.arange(N, device=dev)
    node_valid = node_ar[None, :] < num_nodes[:, None]

    # ancestor rows: entry (i, l) has ancestors path_node[i, 0..l] (and the root)
    tri = torch.arange(L, device=dev)[None, :] <= torch.arange(L, device=dev)[:, None]  # [l, m]
    anc_idx = path_node[:, :, None, :].expand(B, P, L, L).clamp_min(0)  # [B, P, l, m]
    anc_idx = torch.where(tri[None, None], anc_idx, torch.zeros_like(anc_idx))
    entry_anc = torch.zeros((B, P, L, N), dtype=torch.bool, device=dev)
    entry_anc.scatter_(3, anc_idx, True)  # root (0) always set, harmless
    anc = torch.zeros((B, N, N), dtype=torch.bool, device=dev)
    row_of = torch.where(flat_new, slot, torch.zeros_like(slot))  # new entries -> their node
    # write entry rows into node rows; non-new entries go to row 0, which is reset below
    anc.scatter_(1, row_of[:, :, None].expand(B, P * L, N),
                 entry_anc.reshape(B, P * L, N) & flat_new[:, :, None])
    anc[:, 0, :] = False
    anc[:, :, 0] = True
    anc |= torch.eye(N, dtype=torch.bool, device=dev)[None]
    anc &= node_valid[:, None, :] | torch.eye(N, dtype=torch.bool, device=dev)[None]
    return Tree(tokens=tokens, parent=parent, depth=depth, valid=node_valid, anc=anc,
                path_node=path_node, num_nodes=num_nodes, num_entries=valid.sum(dim=(1, 2)))


def prune_paths(paths: torch.Tensor, values: torch.Tensor, budget: torch.Tensor | int) -> torch.Tensor:
    """Keep the ``budget`` most valuable tree nodes (root not counted) of every row.

    Args:
        paths: ``[B, P, L]`` candidate paths.
        values: ``[B, P, L]`` value of each entry (e.g. its estimated probability of being
            accepted); a node's value is the max over the entries that share it. Values must not
            increase along a path (a child is never worth more than its parent), so the kept
            set is prefix-closed.
        budget: int or ``[B]`` long: nodes to keep per row.

    Returns:
        ``[B, P, L]`` paths with dropped entries set to ``PAD``.
    """
    paths = clean_paths(paths)
    B, P, L = paths.shape
    valid, rep, is_new = dedup_paths(paths)
    neg = torch.finfo(values.dtype).min
    flat_val = torch.where(valid, values, neg).reshape(B, P * L)
    rep_flat = (rep * L + torch.arange(L, device=paths.device)).reshape(B, P * L)
    node_val = torch.full_like(flat_val, neg).scatter_reduce(1, rep_flat, flat_val, reduce="amax")
    node_val = torch.where(is_new.reshape(B, -1), node_val, neg)
    # rank nodes by value (stable: earlier paths win ties) and keep the top `budget`
    order = torch.sort(node_val, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(P * L, device=paths.device).expand(B, -1))
    budget = torch.as_tensor(budget, device=paths.device).reshape(-1, 1) if not isinstance(budget, int) else budget
    keep_node = (rank < budget) & is_new.reshape(B, -1)
    keep_entry = keep_node.gather(1, rep_flat).reshape(B, P, L) & valid
    # prefix closure: an entry stays only if every entry before it on its path stays
    keep_entry = keep_entry.to(torch.int8).cumprod(dim=-1).bool()
    return paths.masked_fill(~keep_entry, PAD)
