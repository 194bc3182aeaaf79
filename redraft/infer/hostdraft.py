"""TEMPORARY shim (replaced by the numpy implementation from the hostdraft branch)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from redraft.infer.budget import AcceptanceStats, best_budget
from redraft.infer.tree import build_tree


def context_matches_np(rows, q_min, q_max, k, w, vocab_size, window=4096):
    from redraft.infer.drafters.ngram import context_matches_multi
    B = len(rows)
    T = max(len(r) for r in rows)
    t = torch.full((B, T), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        t[b, :len(r)] = torch.as_tensor(r)
    p, g = context_matches_multi(t, torch.tensor([len(r) for r in rows]), q_min, q_max, k, w, vocab_size, window)
    return p.numpy(), g.numpy()


class HostTables:
    def __init__(self, tables):
        self.t = tables

    def extended(self, last, k=None, w=None):
        return self.t.extended(torch.as_tensor(last)).cpu().numpy()[:, :k, :w]

    def bigram_topk(self, last, k=None):
        i, p = self.t.bigram_topk(torch.as_tensor(last), k)
        return i.cpu().numpy(), p.cpu().numpy()

    def unigram_topk(self, k=None):
        i, p = self.t.unigram_topk(k)
        return i.cpu().numpy(), p.cpu().numpy()


class HostStats:
    def __init__(self, num_drafters, **kw):
        self.s = AcceptanceStats(num_drafters, **kw)

    def values(self, owner, shape, group=None):
        return self.s.values(torch.as_tensor(owner), shape, None if group is None else torch.as_tensor(group)).numpy()

    def update(self, owner, paths, prefix, group=None, kept=None):
        self.s.update(torch.as_tensor(owner), torch.as_tensor(paths), torch.as_tensor(prefix),
                      None if group is None else torch.as_tensor(group), None if kept is None else torch.as_tensor(kept))

    def reset(self):
        self.s.reset()

    def rates(self):
        return self.s.rates().numpy()


def best_budget_np(values, cost_table, max_nodes, overhead_s=0.0):
    from redraft.infer.budget import CostCurve

    n = len(cost_table) - 1
    curve = CostCurve(list(range(1, n + 1)), list(cost_table[1:]))
    return int(best_budget(torch.as_tensor(values), curve, max_nodes, overhead_s)[0]) if values.shape[0] else 0


@dataclass
class HostTree:
    tokens: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    valid: np.ndarray
    anc: np.ndarray
    path_node: np.ndarray
    num_nodes: np.ndarray
    num_entries: np.ndarray
    max_depth: int


def build_tree_np(paths, values, budget, root, size):
    t = build_tree(torch.as_tensor(paths), None if values is None else torch.as_tensor(values), budget,
                   torch.as_tensor(root), size)
    return HostTree(*(x.numpy() for x in (t.tokens, t.parent, t.depth, t.valid, t.anc, t.path_node, t.num_nodes,
                                            t.num_entries)), t.max_depth)
