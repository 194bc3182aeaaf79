"""Acceptance over a verified draft tree in torch: greedy, lossless rejection sampling, typical,
each one function of the tree and the target's logits at every node (``logits[b, n]``: the
target's next-token distribution *after* node n) returning an :class:`Acceptance`. The oracle
of what the decoder runs: ``redraft.infer.spec.accept.step_choices`` on the device and ``walk``
on the host (see that module's doc for the rules).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redraft.infer.config import TYPICAL_DELTA, TYPICAL_EPS
from redraft.infer.spec.accept import RowSampling, greedy_tokens, sample_tokens, warp_probs
from redraft.infer.spec.paths import PAD
from reference.tree import Tree


@dataclass
class Acceptance:
    """Result of acceptance for every row.

    Attributes:
        path: ``[B, D+1]`` long node indices of the accepted path, root first, ``-1`` padded
            (``D`` = the tree's ``max_depth``).
        num_accepted: ``[B]`` long accepted draft tokens (the root not counted).
        last_node: ``[B]`` long deepest accepted node (0 when nothing was accepted).
        bonus: ``[B]`` long the token the target produces after the accepted path.
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    last_node: torch.Tensor
    bonus: torch.Tensor


def _path_from_last(tree: Tree, last: torch.Tensor) -> Acceptance:
    """Accepted path (root first) from the deepest accepted node, via the ancestor matrix."""
    B, N = tree.tokens.shape
    dev = last.device
    on_path = tree.anc[torch.arange(B, device=dev), last]  # [B, N]
    D = tree.max_depth + 1
    node_ar = torch.arange(N, device=dev).expand(B, N)
    # each depth has exactly one node on the path: scatter node index into its depth slot
    slot = torch.where(on_path, tree.depth, torch.full_like(tree.depth, D))
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=dev).scatter_(1, slot, node_ar)[
        :, :D
    ]
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


def _follow(tree: Tree, choice: torch.Tensor) -> Acceptance:
    """Accept the deepest node reached by following ``choice [B, N]`` (the token taken after
    each node) from the root; the bonus is the choice after that node."""
    last = _deepest(tree, _child_ok(tree, choice))
    acc = _path_from_last(tree, last)
    acc.bonus = choice.gather(1, last[:, None])[:, 0]
    return acc


def accept_greedy(tree: Tree, logits: torch.Tensor, rows: RowSampling | None = None) -> Acceptance:
    """Greedy acceptance. ``logits [B, N, V]`` -> :class:`Acceptance` (bonus = argmax)."""
    return _follow(tree, greedy_tokens(logits))


def accept_rejection(tree: Tree, logits: torch.Tensor, rows: RowSampling) -> Acceptance:
    """Lossless rejection sampling over the tree (see the module doc): greedy rows take the
    argmax, sampled rows follow one draw from the warped target distribution per node."""
    return _follow(tree, sample_tokens(logits, rows, tree.depth))


def accept_typical(
    tree: Tree,
    logits: torch.Tensor,
    rows: RowSampling,
    eps: float = TYPICAL_EPS,
    delta: float = TYPICAL_DELTA,
) -> Acceptance:
    """Typical acceptance: ``p(t) > min(eps, delta * exp(-H(p_parent)))``. Not lossless.
    Probabilities are at each row's temperature (1 for greedy rows)."""
    temp = torch.where(rows.temperature > 0, rows.temperature, torch.ones_like(rows.temperature))
    probs = warp_probs(logits, temp)  # [B, N, V]
    ent = -(probs * probs.clamp_min(1e-20).log()).sum(dim=-1)  # [B, N]
    thresh = torch.minimum(torch.full_like(ent, eps), delta * torch.exp(-ent))
    par = tree.parent.clamp_min(0)
    p_tok = probs.gather(1, par[:, :, None].expand_as(probs)).gather(
        2, tree.tokens.clamp_min(0)[:, :, None]
    )[:, :, 0]
    ok = (p_tok > thresh.gather(1, par)) & tree.valid
    ok[:, 0] = True
    ok |= _child_ok(tree, greedy_tokens(logits))  # the target's own argmax is always acceptable
    last = _deepest(tree, ok)
    acc = _path_from_last(tree, last)
    last_logits = logits[torch.arange(logits.shape[0], device=logits.device), last]
    acc.bonus = sample_tokens(last_logits, rows, acc.num_accepted)
    return acc


ACCEPT = {"greedy": accept_greedy, "rejection": accept_rejection, "typical": accept_typical}


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
