"""The math of one micro batch: the target's features, the head's loss, held-out metrics.

    hidden   = target_hidden(target, ids)              [B, T, H]  (or cached: batch.hidden)
    windows  = make_windows(ids, mask, n)              P positions x n steps (losses.py)
    logits   = head(hidden[windows], windows.tokens)   [P, n, Vd] every position, every step, one pass
    teacher  = log p_target(. | prefix) at each target [P, n, Vd] (only for the KD loss)
    loss     = drafter_loss(logits, targets, valid, teacher)
"""

from __future__ import annotations

import math

import numpy as np
import torch

from redraft.models.redrafter import ReDrafter
from redraft.train.batches import Batch, collate, sequence_lengths
from redraft.train.config import TrainConfig
from redraft.train.losses import EvalAccumulator, drafter_loss, make_windows, target_next_positions
from redraft.train.precision import autocast, head_autocast


def target_hidden(target, ids: torch.Tensor, precision: str) -> torch.Tensor:
    """The target's last hidden states (the LM head's input), ``[B, T, H]``, no graph.

    Right padding needs no attention mask: causal attention never looks at later pad tokens.
    """
    with torch.inference_mode(), autocast(ids.device, precision):
        return target.model.base_model(input_ids=ids, use_cache=False).last_hidden_state


def target_greedy(target, hidden: torch.Tensor, precision: str, chunk: int = 512) -> torch.Tensor:
    """``argmax(lm_head(hidden))`` [B, T]: the target's greedy next token at every position."""
    head = target.output_head
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = []
    with torch.inference_mode(), autocast(hidden.device, precision):
        for i in range(0, flat.shape[0], chunk):  # chunks bound the [chunk, V] logits in memory
            out.append(head(flat[i: i + chunk]).argmax(-1))
    return torch.cat(out).view(hidden.shape[:-1])


def target_topk(target, hidden: torch.Tensor, precision: str, k: int,
                chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-``k`` next-token ``(ids int32, logits float32)``, each ``[..., k]``,
    for hidden states ``[..., H]`` (the cached teacher of the KD loss)."""
    head = target.output_head
    flat = hidden.reshape(-1, hidden.shape[-1])
    ids, vals = [], []
    with torch.inference_mode(), autocast(hidden.device, precision):
        for i in range(0, flat.shape[0], chunk):  # chunks bound the [chunk, V] logits in memory
            top = head(flat[i: i + chunk]).float().topk(k, dim=-1)
            vals.append(top.values)
            ids.append(top.indices.to(torch.int32))
    shape = (*hidden.shape[:-1], k)
    return torch.cat(ids).view(shape), torch.cat(vals).view(shape)


def topk_teacher_logprobs(model: ReDrafter, topk_ids: torch.Tensor, topk_logits: torch.Tensor) -> torch.Tensor:
    """Dense teacher log-probabilities ``[P, n, Vd]`` from the target's top-k logits ``[P, n, k]``.

    The distribution is the softmax over the top-k ids that lie in the draft vocabulary (the
    online teacher is the softmax over the whole draft vocabulary: the two agree when the top k
    hold all the mass). Every other entry is the most negative float, whose probability is
    exactly 0, so ``p * (log p - log q)`` is 0 there (with -inf it would be NaN).
    """
    d = model.to_draft_ids(topk_ids.long())  # [P, n, k], -1 outside the draft vocabulary
    inside = d >= 0
    vals = topk_logits.float().masked_fill(~inside, float("-inf"))
    logp = vals - vals.logsumexp(-1, keepdim=True)  # NaN only in rows with nothing inside: masked below
    low = torch.finfo(torch.float32).min
    Vd = model.config.out_vocab_size
    # ids outside the draft vocabulary go to a spare last column, dropped after the scatter
    dense = torch.full((*d.shape[:-1], Vd + 1), low, device=d.device)
    dense.scatter_(-1, torch.where(inside, d, Vd), torch.where(inside, logp, low))
    return dense[..., :Vd]


def full_teacher_logprobs(model: ReDrafter, target, hidden: torch.Tensor, b, j, precision: str) -> torch.Tensor:
    """Teacher log-probabilities ``[P, n, Vd]`` from the target's LM head on ``hidden[b, j]``
    (softmax over the draft vocabulary)."""
    with torch.inference_mode(), autocast(hidden.device, precision):
        tl = target.output_head(hidden[b, j])  # [P, n, V]
        if model.config.draft_vocab_size is not None:
            tl = tl[..., model.draft_to_target]
        tlp = tl.float().log_softmax(-1)
    return tlp.clone()  # out of inference mode


@torch.no_grad()
def warm_start_from_target(model: ReDrafter, target) -> None:
    """Output layer = the target's LM head on the x half (zeros on the state half), ResNet blocks =
    identity (zero weights: ``h + silu(0) = h``), so the untrained head starts from the target's
    own vocabulary geometry instead of a random projection (as Medusa initialises its heads)."""
    S = model.config.state_size
    W = target.output_head.weight.detach().float()  # [V, H]
    if model.config.draft_vocab_size is not None:
        W = W[model.draft_to_target.to(W.device)]
    model.lm_head.weight.zero_()
    model.lm_head.weight[:, S:] = W.to(model.lm_head.weight)
    for block in model.blocks:
        block.linear.weight.zero_()
        block.linear.bias.zero_()


def batch_loss(model: ReDrafter, forward, target, batch: Batch, cfg: TrainConfig, precision: str,
               hidden_dtype: torch.dtype | None = None):
    """Loss of one micro batch. ``forward`` is the DeepSpeed engine (or the module in eval).

    The hidden states (and the KD teacher) come from ``batch`` when it carries cached features,
    else from a target forward. ``hidden_dtype``: what cached hidden states are cast to (the
    dtype the online target would give).

    Returns ``(loss, stats, logits, windows, targets_draft)``.
    """
    ids, mask = batch.ids, batch.mask
    if batch.hidden is not None:
        hidden = batch.hidden if hidden_dtype is None else batch.hidden.to(hidden_dtype)
    else:
        hidden = target_hidden(target, ids, precision)  # [B, T, H]
    win = make_windows(ids, mask, cfg.num_steps)
    ctx = hidden[win.batch_idx, win.pos_idx]  # [P, H], a normal tensor (indexing leaves inference mode)
    with head_autocast(ids.device, precision):
        logits = forward(ctx, win.tokens)  # [P, n, Vd]: every position, every step, one pass
    targets_d = model.to_draft_ids(win.targets)
    teacher = None
    if cfg.loss in ("kd", "ce+kd"):
        b, j = target_next_positions(win, ids.shape[1])
        if batch.topk_ids is not None:
            teacher = topk_teacher_logprobs(model, batch.topk_ids[b, j], batch.topk_logits[b, j])
        else:
            teacher = full_teacher_logprobs(model, target, hidden, b, j, precision)
    ce_w = 0.0 if cfg.loss == "kd" else 1.0
    kd_w = 0.0 if cfg.loss == "ce" else (1.0 if cfg.loss == "kd" else cfg.kd_weight)
    loss, stats = drafter_loss(logits, targets_d, win.valid, teacher, ce_weight=ce_w, kd_weight=kd_w)
    return loss, stats, logits, win, targets_d


@torch.no_grad()
def evaluate(model: ReDrafter, forward, target, ds, cfg: TrainConfig, env, precision: str) -> dict:
    """Held-out metrics (:class:`~redraft.train.losses.EvalAccumulator`), summed over all ranks.

    Every rank runs the same number of batches (ZeRO-3 forwards are collective); a rank
    with nothing left repeats a batch and does not count it.
    """
    was_training = model.training
    model.eval()
    lengths = sequence_lengths(ds)
    order = np.argsort(-lengths, kind="stable")  # similar lengths together: little padding
    mine = order[env.rank:: env.world_size]
    bs = cfg.eval_batch_size
    n_batches = math.ceil(math.ceil(len(order) / env.world_size) / bs)
    acc = EvalAccumulator(cfg.num_steps, device=env.device)
    for k in range(n_batches):
        idx = mine[k * bs: (k + 1) * bs]
        count = len(idx) > 0
        if not count:
            idx = order[:1]
        ids, mask = collate(ds, idx, env.device)
        hidden = target_hidden(target, ids, precision)
        greedy = target_greedy(target, hidden, precision)  # [B, T]
        win = make_windows(ids, mask, cfg.num_steps)
        ctx = hidden[win.batch_idx, win.pos_idx]
        with head_autocast(ids.device, precision):
            logits = forward(ctx, win.tokens)
        b, j = target_next_positions(win, ids.shape[1])
        greedy_t = greedy[b, j]  # [P, n] the target's own token at each target position
        if count:
            acc.add(logits, model.to_draft_ids(win.targets), model.to_draft_ids(greedy_t),
                    win.targets == greedy_t, win.valid)
    env.all_reduce(t := acc.as_tensor())
    acc.load_tensor(t)
    model.train(was_training)
    return acc.result()
