"""The drafter's training loss, in one place: the trainer (``redraft.train``) and
``ReDrafter.forward(..., labels=...)`` both call :func:`drafter_loss`.

It lives in the models layer because the head's ``forward`` needs it and ``models`` must not
import ``train`` (README.md, "Layout": a stage depends only on stages to its left).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # a label that takes no part in the loss (the transformers convention)


def drafter_loss(logits: torch.Tensor, targets_draft: torch.Tensor, valid: torch.Tensor,
                 target_logprobs: torch.Tensor | None = None, ce_weight: float = 1.0,
                 kd_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Mean over steps of the masked per-step loss.

    Args:
        logits: ``[P, n, Vd]`` drafter logits.
        targets_draft: ``[P, n]`` targets as draft ids (``-1`` = outside the draft vocabulary).
        valid: ``[P, n]`` bool mask of assistant targets.
        target_logprobs: ``[P, n, Vd]`` the target's log-probabilities (for the KD term), or None.
        ce_weight, kd_weight: weights of cross-entropy and KL(target || drafter).

    Returns:
        ``(loss, stats)``: a scalar, and ``stats["step_loss"]`` ``[n]`` (detached, per step),
        ``stats["step_count"]`` ``[n]`` valid targets per step.
    """
    P, n, V = logits.shape
    logp = logits.float().log_softmax(-1)  # [P, n, Vd]
    w = valid.float()  # [P, n]
    per_tok = logits.new_zeros(P, n, dtype=torch.float32)
    if ce_weight:
        ce_valid = valid & (targets_draft >= 0)  # out-of-vocab targets cannot be learned: skipped
        tgt = torch.where(ce_valid, targets_draft, 0)
        nll = -logp.gather(-1, tgt[..., None]).squeeze(-1)  # [P, n]
        per_tok = per_tok + ce_weight * nll * ce_valid
    if kd_weight and target_logprobs is not None:
        tp = target_logprobs.float()
        kl = (tp.exp() * (tp - logp)).sum(-1)  # [P, n]  KL(p_target || p_draft)
        per_tok = per_tok + kd_weight * kl * w
    count = w.sum(0)  # [n]
    step_loss = per_tok.sum(0) / count.clamp(min=1)  # [n]
    has = count > 0
    loss = step_loss[has].mean() if bool(has.any()) else logits.sum() * 0.0  # keeps the graph
    return loss, {"step_loss": step_loss.detach(), "step_count": count.detach()}
