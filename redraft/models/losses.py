"""The drafter's training loss, in one place: the trainer (``redraft.train``) and
``ReDrafter.forward(..., labels=...)`` both use it.

The loss is the mean over draft steps of the masked per-step mean of

    ce_weight * CE(data token)  +  kd_weight * KL(p_target || p_draft)

Two implementations of that one formula:

* :func:`drafter_loss` takes dense logits ``[P, n, Vd]`` (the reference; tests, evaluation and
  ``forward(labels=...)``);
* :func:`fused_drafter_loss` takes the features before the output layer ``[P, n, D]`` and the
  output weight ``[Vd, D]`` and never holds more than ``chunk_rows x Vd`` logits: per chunk it
  computes the logits, the loss and the loss's gradients with respect to the features and the
  weight at once (the idea of Liger's fused linear cross-entropy), so the backward pass is a
  multiplication. With ``P * n = 5 * 1024`` rows and ``Vd = 49152`` the dense path holds several
  1 GB float32 tensors; the fused one a few ``chunk_rows x Vd`` ones.

The KD teacher is the target's top-k next-token distribution (``teacher_ids`` / ``teacher_logp``,
``[P, n, k]``), renormalised over the top-k ids inside the draft vocabulary; when the top k hold
all the mass it is the full teacher.

Per-token weights come from the masks alone (:func:`step_weights`), so neither path reads the
device on the host.

It lives in the models layer because the head's ``forward`` needs it and ``models`` must not
import ``train`` (docs/architecture.md: a stage depends only on stages to its left).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # a label that takes no part in the loss (the transformers convention)

# Rows of logits computed at once by the fused loss: 2048 x 49152 float32 is 400 MB per buffer.
DEFAULT_CHUNK_ROWS = 2048


def step_decay_factors(has: torch.Tensor, decay: float) -> torch.Tensor:
    """``[n]`` factors ``decay**i`` renormalised to a mean of 1 over the steps ``has`` marks
    (``[n]``, those with a position): a step's share of the loss under ``step_decay``."""
    d = decay ** torch.arange(has.shape[0], device=has.device, dtype=torch.float32)
    has = has.float()
    return d * has.sum().clamp(min=1) / (d * has).sum().clamp(min=torch.finfo(torch.float32).tiny)


def step_weights(valid: torch.Tensor, decay: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [P, n], count [n])``: ``sum(weight * per_token_loss)`` is the mean over the steps
    that have a valid token of each step's mean loss (``decay`` < 1: step i's mean weighted by
    :func:`step_decay_factors`, the early steps, which every accepted chain needs, counting more).
    Pure tensor ops (no host read)."""
    count = valid.float().sum(0)  # [n]
    has = (count > 0).float()
    per_step = has / (count.clamp(min=1) * has.sum().clamp(min=1))  # [n]
    if decay != 1.0:
        per_step = per_step * step_decay_factors(has, decay)
    return valid.float() * per_step, count


def drafter_loss(
    logits: torch.Tensor,
    targets_draft: torch.Tensor,
    valid: torch.Tensor,
    target_logprobs: torch.Tensor | None = None,
    ce_weight: float = 1.0,
    kd_weight: float = 0.0,
    kd_valid: torch.Tensor | None = None,
    step_decay: float = 1.0,
) -> tuple[torch.Tensor, dict]:
    """Mean over steps of the masked per-step loss, from dense logits.

    Args:
        logits: ``[P, n, Vd]`` drafter logits.
        targets_draft: ``[P, n]`` targets as draft ids (``-1`` = outside the draft vocabulary).
        valid: ``[P, n]`` bool mask of assistant targets (the cross-entropy's positions).
        target_logprobs: ``[P, n, Vd]`` the target's log-probabilities (for the KD term), or None.
        ce_weight, kd_weight: weights of cross-entropy and KL(target || drafter).
        kd_valid: ``[P, n]`` bool mask of the KL term's positions (a superset of ``valid``, e.g.
            every real token: ``kd_positions: all``); None = ``valid``. Each term is its own
            mean over the steps of its per-step means.
        step_decay: step i's mean counts ``step_decay**i`` (renormalised to a mean of 1;
            :func:`step_weights`); 1 = the plain mean.

    Returns:
        ``(loss, stats)``: a scalar, and ``stats["step_loss"]`` ``[n]`` (detached, per step: the
        step's mean CE plus its mean KL, weighted by ce/kd_weight, not by the decay),
        ``stats["step_count"]`` ``[n]`` valid targets per step.
    """
    P, n, V = logits.shape
    logp = logits.float().log_softmax(-1)  # [P, n, Vd]
    kd_mask = valid if kd_valid is None else kd_valid
    weight, count = step_weights(valid, step_decay)
    kd_weights, kd_count = (
        (weight, count) if kd_valid is None else step_weights(kd_valid, step_decay)
    )
    loss = logits.new_zeros((), dtype=torch.float32)
    step_loss = logits.new_zeros(n, dtype=torch.float32)
    if ce_weight:
        ce_valid = valid & (targets_draft >= 0)  # out-of-vocab targets cannot be learned: skipped
        tgt = torch.where(ce_valid, targets_draft, 0)
        nll = -logp.gather(-1, tgt[..., None]).squeeze(-1) * ce_valid  # [P, n]
        loss = loss + ce_weight * (nll * weight).sum()
        step_loss = step_loss + ce_weight * nll.sum(0) / count.clamp(min=1)
    if kd_weight and target_logprobs is not None:
        tp = target_logprobs.float()
        kl = (tp.exp() * (tp - logp)).sum(-1) * kd_mask  # [P, n]  KL(p_target || p_draft)
        loss = loss + kd_weight * (kl * kd_weights).sum()
        step_loss = step_loss + kd_weight * kl.sum(0) / kd_count.clamp(min=1)
    return loss, {"step_loss": step_loss.detach(), "step_count": count.detach()}


def sparse_teacher(
    teacher_draft_ids: torch.Tensor, teacher_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k as a distribution over the draft vocabulary.

    Args:
        teacher_draft_ids: ``[..., k]`` draft ids of the target's top-k tokens (``-1`` outside).
        teacher_logits: ``[..., k]`` their logits.

    Returns:
        ``(ids [..., k] long (0 where outside), probs [..., k] float32)``: the softmax over the
        entries inside the draft vocabulary, 0 elsewhere (all 0 when none is inside).
    """
    inside = teacher_draft_ids >= 0
    vals = teacher_logits.float().masked_fill(~inside, float("-inf"))
    probs = torch.nan_to_num(vals.softmax(-1), nan=0.0)  # a row with nothing inside: NaN -> 0
    return torch.where(inside, teacher_draft_ids, 0).long(), probs * inside


class _FusedLinearDrafterLoss(torch.autograd.Function):
    """``sum_r w_ce[r] * CE(h_r W^T, t_r) + w_kd[r] * KL(p_r || softmax(h_r W^T))`` over rows.

    Forward computes the gradients chunk by chunk and keeps them; backward scales them.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, w_ce, w_kd, t_ids, t_probs, chunk_rows):
        # h [N, D], weight [Vd, D], targets [N] (>= 0), w_ce / w_kd [N] float32,
        # t_ids / t_probs [N, k] (k = 0: no KD term)
        dev = h.device.type
        # the matmuls run in the autocast dtype (bf16 under amp) with the weight cast once, not per chunk
        cd = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
        with torch.autocast(dev, enabled=False):
            return _FusedLinearDrafterLoss._chunks(
                ctx,
                h,
                weight,
                weight.to(cd),
                h.to(cd),
                targets,
                w_ce,
                w_kd,
                t_ids,
                t_probs,
                chunk_rows,
            )

    @staticmethod
    def _chunks(ctx, h, weight, w_c, h_c, targets, w_ce, w_kd, t_ids, t_probs, chunk_rows):
        N = h.shape[0]
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        per_tok = torch.empty(N, dtype=torch.float32, device=h.device)
        top1 = torch.empty(N, dtype=torch.bool, device=h.device)
        for s in range(0, N, chunk_rows):
            e = min(s + chunk_rows, N)
            hc, tgt, wce = h_c[s:e], targets[s:e, None], w_ce[s:e]
            z = torch.matmul(hc, w_c.t()).float()  # [c, Vd]
            lse = z.logsumexp(-1, keepdim=True)  # [c, 1]
            top1[s:e] = z.argmax(-1) == targets[s:e]
            loss_c = wce * (lse - z.gather(-1, tgt)).squeeze(-1)
            coef = wce
            if t_ids.shape[-1]:
                p, ids, wkd = t_probs[s:e], t_ids[s:e], w_kd[s:e]
                # KL = sum p log p - sum p (z - lse);  d/dz = mass * softmax(z) - p
                plogp = torch.where(p > 0, p * p.clamp(min=1e-30).log(), 0.0).sum(-1)
                cross = (p * (z.gather(-1, ids) - lse)).sum(-1)
                loss_c = loss_c + wkd * (plogp - cross)
                coef = coef + wkd * p.sum(-1)  # mass: 1, or 0 where no top-k id is a draft id
            g = z.sub_(lse).exp_().mul_(coef[:, None])  # in place of z: [c, Vd]
            g.scatter_add_(-1, tgt, -wce[:, None])
            if t_ids.shape[-1]:
                g.scatter_add_(-1, ids, -wkd[:, None] * p)
            per_tok[s:e] = loss_c
            g = g.to(w_c.dtype)
            grad_h[s:e] = torch.matmul(g, w_c).to(h.dtype)  # [c, D]
            grad_w += torch.matmul(g.t(), hc).float()  # [Vd, D]
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        ctx.mark_non_differentiable(per_tok, top1)
        return per_tok.sum(), per_tok, top1

    @staticmethod
    def backward(ctx, grad_loss, _grad_per_tok, _grad_top1):
        grad_h, grad_w = ctx.saved_tensors
        return (
            grad_h * grad_loss.to(grad_h.dtype),
            grad_w * grad_loss.to(grad_w.dtype),
            *([None] * 6),
        )


def fused_drafter_loss(
    features: torch.Tensor,
    weight: torch.Tensor,
    targets_draft: torch.Tensor,
    valid: torch.Tensor,
    teacher_ids: torch.Tensor | None = None,
    teacher_probs: torch.Tensor | None = None,
    ce_weight: float = 1.0,
    kd_weight: float = 0.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    kd_valid: torch.Tensor | None = None,
    step_decay: float = 1.0,
) -> tuple[torch.Tensor, dict]:
    """:func:`drafter_loss` of ``logits = features @ weight.T`` without holding the logits.

    Args:
        features: ``[P, n, D]`` the head's features before its output layer.
        weight: ``[Vd, D]`` the output layer's weight.
        targets_draft, valid: as in :func:`drafter_loss`.
        teacher_ids, teacher_probs: ``[P, n, k]`` the KD teacher (:func:`sparse_teacher`), or None.
        ce_weight, kd_weight: weights of the two terms.
        chunk_rows: rows of logits computed at once.
        kd_valid, step_decay: as in :func:`drafter_loss`.

    Returns:
        ``(loss, stats)`` as :func:`drafter_loss`, and ``stats["top1"]`` ``[P, n]`` bool: the
        drafter's top-1 equals the data token (for the training meter, free here).
    """
    P, n, D = features.shape
    weights, count = step_weights(valid, step_decay)
    ce_valid = valid & (targets_draft >= 0)
    w_ce = (weights * ce_valid * ce_weight).reshape(-1)
    use_kd = bool(kd_weight) and teacher_ids is not None
    kd_weights = weights if kd_valid is None else step_weights(kd_valid, step_decay)[0]
    w_kd = (kd_weights * kd_weight).reshape(-1) if use_kd else torch.zeros_like(w_ce)
    if use_kd:
        k = teacher_ids.shape[-1]  # explicit: P may be 0 (a batch with nothing to learn)
        t_ids, t_probs = (
            teacher_ids.reshape(P * n, k).long(),
            teacher_probs.reshape(P * n, k).float(),
        )
    else:
        t_ids = torch.zeros(P * n, 0, dtype=torch.long, device=features.device)
        t_probs = torch.zeros(P * n, 0, device=features.device)
    targets = targets_draft.clamp(min=0).reshape(-1)
    loss, per_tok, top1 = _FusedLinearDrafterLoss.apply(
        features.reshape(P * n, D), weight, targets, w_ce, w_kd, t_ids, t_probs, chunk_rows
    )
    # per_tok is weighted by step (1 / (count_i * steps)); times the number of steps that have a
    # position it is the step's mean CE plus its mean KL (kd_valid covers valid: its steps)
    has = count > 0 if not use_kd or kd_valid is None else kd_valid.any(0)
    per_step = per_tok.view(P, n).sum(0) * has.sum() * has
    if step_decay != 1.0:  # the stats are the steps' means, undecayed
        per_step = per_step / step_decay_factors(has, step_decay)
    return loss, {
        "step_loss": per_step.detach(),
        "step_count": count.detach(),
        "top1": top1.view(P, n) & ce_valid,
    }
