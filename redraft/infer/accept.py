"""Acceptance over a verified draft tree: greedy, lossless rejection sampling, typical.

Every function takes the tree and the target's logits at every node (``logits[b, n]`` is the
target's next-token distribution *after* node n) and returns an :class:`Acceptance`: the
accepted path (root first) and the bonus token the target contributes after it.

* greedy: a node is correct iff its token is the target's argmax after its parent; the deepest
  node whose whole ancestry is correct wins. Output equals plain greedy decoding.
* rejection: recursive rejection sampling over siblings (SpecInfer's multi-step speculative
  sampling). At the current node with target distribution p, try the children in order: a child
  with token t drafted deterministically is accepted with probability ``p(t)`` (q = delta), and
  on rejection ``p <- normalise(p with t removed)``; a child sampled from ``q`` is accepted with
  ``min(1, p(t)/q(t))`` and on rejection ``p <- normalise(max(p - q, 0))``. When every child is
  rejected the bonus is sampled from the residual p. The emitted tokens follow the target's
  (temperature/top-p warped) distribution exactly.
* typical (Medusa): a node is accepted when ``p(t) > min(eps, delta * exp(-H(p)))`` under its
  parent's distribution; the deepest fully accepted node wins; the bonus is the argmax (greedy)
  or a sample (temperature > 0) from the last node's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redraft.infer.drafters.base import PAD
from redraft.infer.tree import Tree

TYPICAL_EPS = 0.3
TYPICAL_DELTA = 0.09


@dataclass
class Acceptance:
    """Result of acceptance for every row.

    Attributes:
        path: ``[B, D+1]`` long node indices of the accepted path, root first, ``-1`` padded.
        num_accepted: ``[B]`` long accepted draft tokens (the root not counted).
        last_node: ``[B]`` long deepest accepted node (0 when nothing was accepted).
        bonus: ``[B]`` long the token the target produces after the accepted path.
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    last_node: torch.Tensor
    bonus: torch.Tensor


def warp_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Target distribution after temperature and nucleus (top-p) warping: ``[..., V]`` probs."""
    logits = logits.float() / max(temperature, 1e-6)
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) >= top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits.softmax(dim=-1)


def _path_from_last(tree: Tree, last: torch.Tensor) -> Acceptance:
    """Accepted path (root first) from the deepest accepted node, via the ancestor matrix."""
    B, N = tree.tokens.shape
    dev = last.device
    on_path = tree.anc[torch.arange(B, device=dev), last]  # [B, N]
    D = int(tree.depth.max()) + 1
    path = torch.full((B, D), -1, dtype=torch.long, device=dev)
    node_ar = torch.arange(N, device=dev).expand(B, N)
    # each depth has exactly one node on the path: scatter node index into its depth slot
    slot = torch.where(on_path, tree.depth, torch.full_like(tree.depth, D))
    path = torch.cat([path, path[:, :1]], dim=1).scatter_(1, slot, node_ar)[:, :D]
    num = tree.depth.gather(1, last[:, None])[:, 0]
    path = torch.where(torch.arange(D, device=dev)[None] <= num[:, None], path, -1)
    return Acceptance(path=path, num_accepted=num, last_node=last, bonus=torch.zeros_like(last))


def _deepest(tree: Tree, ok: torch.Tensor) -> torch.Tensor:
    """Deepest node with ``ok`` on it and all its ancestors; ties go to the lower index."""
    N = tree.tokens.shape[1]
    full = ~(tree.anc & ~ok[:, None, :]).any(dim=-1) & tree.valid  # [B, N]
    score = torch.where(full, tree.depth * N + (N - 1 - torch.arange(N, device=ok.device)), -1)
    return score.argmax(dim=1)


def _child_ok(tree: Tree, parent_choice: torch.Tensor) -> torch.Tensor:
    """``parent_choice [B, N]``: token chosen after each node -> is each node its parent's choice."""
    ok = tree.tokens == parent_choice.gather(1, tree.parent.clamp_min(0))
    ok[:, 0] = True
    return ok & tree.valid


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim, the first index on ties. ``max().indices`` computes the same as
    ``argmax`` but 4.5x faster for bfloat16 logits on CPU (2.4 ms vs 0.5 ms for 14 x 49152).
    Plain decoding and verification both use this, so their tie rule is the same."""
    return logits.max(dim=-1).indices


def accept_greedy(tree: Tree, logits: torch.Tensor) -> Acceptance:
    """Greedy acceptance. ``logits [B, N, V]`` -> :class:`Acceptance` (bonus = argmax)."""
    top = greedy_tokens(logits)  # [B, N]
    last = _deepest(tree, _child_ok(tree, top))
    acc = _path_from_last(tree, last)
    acc.bonus = top.gather(1, last[:, None])[:, 0]
    return acc


def accept_typical(tree: Tree, logits: torch.Tensor, temperature: float = 0.0,
                   eps: float = TYPICAL_EPS, delta: float = TYPICAL_DELTA,
                   generator: torch.Generator | None = None) -> Acceptance:
    """Typical acceptance: ``p(t) > min(eps, delta * exp(-H(p_parent)))``. Not lossless."""
    probs = warp_probs(logits, temperature if temperature > 0 else 1.0)  # [B, N, V]
    ent = -(probs * probs.clamp_min(1e-20).log()).sum(dim=-1)  # [B, N]
    thresh = torch.minimum(torch.full_like(ent, eps), delta * torch.exp(-ent))
    par = tree.parent.clamp_min(0)
    p_tok = probs.gather(1, par[:, :, None].expand_as(probs)).gather(2, tree.tokens.clamp_min(0)[:, :, None])[:, :, 0]
    ok = (p_tok > thresh.gather(1, par)) & tree.valid
    ok[:, 0] = True
    # the target's own argmax is always acceptable (keeps greedy output reachable)
    ok |= _child_ok(tree, greedy_tokens(logits))
    last = _deepest(tree, ok)
    acc = _path_from_last(tree, last)
    last_probs = probs[torch.arange(probs.shape[0], device=probs.device), last]
    if temperature > 0:
        acc.bonus = torch.multinomial(last_probs, 1, generator=generator)[:, 0]
    else:
        acc.bonus = greedy_tokens(last_probs)
    return acc


def accept_rejection(tree: Tree, logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                     node_q: torch.Tensor | None = None, generator: torch.Generator | None = None,
                     probs: torch.Tensor | None = None) -> Acceptance:
    """Lossless recursive rejection sampling over the tree.

    Args:
        tree: the verified tree.
        logits: ``[B, N, V]`` target logits at every node (ignored when ``probs`` is given).
        temperature, top_p: the target distribution to sample from.
        node_q: ``[B, N, V]`` or ``None``: for nodes whose token was *sampled* from a draft
            distribution, that distribution; rows of zeros (or ``None``) mean deterministic.
        generator: random source (tests pass a seeded one).
        probs: ``[B, N, V]`` already warped target probabilities.

    The loop runs over tree depth and sibling rank (a handful of steps), each vectorised over
    the batch.
    """
    if probs is None:
        probs = warp_probs(logits, temperature, top_p)
    B, N, V = probs.shape
    dev = probs.device
    rows = torch.arange(B, device=dev)
    node_ar = torch.arange(N, device=dev)
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)  # still descending
    bonus = torch.zeros(B, dtype=torch.long, device=dev)
    is_child_of = tree.valid & (node_ar[None] > 0)  # candidates, restricted by parent below
    max_depth = int(tree.depth.max())
    for _ in range(max_depth + 1):
        resid = probs[rows, cur]  # [B, V]
        kids = is_child_of & (tree.parent == cur[:, None])  # [B, N]
        rank = kids.long().cumsum(dim=1) - 1  # sibling order = node index order
        n_kids = kids.sum(dim=1)
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        for r in range(int(n_kids.max()) if B else 0):
            has = kids & (rank == r)
            child = torch.where(has.any(dim=1), has.long().argmax(dim=1), 0)
            trying = alive & ~moved & (n_kids > r)
            tok = tree.tokens[rows, child].clamp_min(0)
            p_t = resid[rows, tok]
            if node_q is not None:
                q = node_q[rows, child]  # [B, V]
                stochastic = q.sum(dim=-1) > 0
                q_t = torch.where(stochastic, q[rows, tok], torch.ones_like(p_t))
            else:
                q, stochastic, q_t = None, torch.zeros_like(trying), torch.ones_like(p_t)
            ratio = (p_t / q_t.clamp_min(1e-20)).clamp(max=1.0)
            u = torch.rand(B, device=dev, generator=generator)
            ok = trying & (u < ratio)
            cur = torch.where(ok, child, cur)
            moved |= ok
            rej = trying & ~ok
            # residual after rejecting this child: delta -> zero t; sampled -> max(p - q, 0)
            new_resid = resid.clone()
            new_resid[rows, tok] = 0.0
            if q is not None:
                new_resid = torch.where(stochastic[:, None], (resid - q).clamp_min(0.0), new_resid)
            norm = new_resid.sum(dim=-1, keepdim=True)
            new_resid = torch.where(norm > 0, new_resid / norm.clamp_min(1e-30), resid)
            resid = torch.where(rej[:, None], new_resid, resid)
        stop = alive & ~moved
        if stop.any():
            sample = torch.multinomial(resid, 1, generator=generator)[:, 0]
            bonus = torch.where(stop, sample, bonus)
        alive &= moved
        if not alive.any():
            break
    acc = _path_from_last(tree, cur)
    acc.bonus = bonus
    return acc


def accepted_tokens(tree: Tree, acc: Acceptance) -> torch.Tensor:
    """``[B, D]`` accepted draft tokens (root excluded), ``PAD``-padded."""
    path = acc.path[:, 1:]
    tok = tree.tokens.gather(1, path.clamp_min(0))
    return torch.where(path >= 0, tok, PAD)


def emitted_tokens(tree: Tree, acc: Acceptance) -> torch.Tensor:
    """``[B, D+1]`` tokens a step emits: the accepted draft tokens then the bonus, ``PAD``-padded."""
    toks = accepted_tokens(tree, acc)
    D = toks.shape[1]
    ar = torch.arange(D + 1, device=toks.device)[None]
    out = torch.cat([toks, toks.new_full((toks.shape[0], 1), PAD)], dim=1)
    out = torch.where(ar == acc.num_accepted[:, None], acc.bonus[:, None], out)
    return torch.where(ar <= acc.num_accepted[:, None], out, PAD)
