"""liger-kernel's fused linear cross-entropy for the drafter loss (CUDA only, optional).

``loss_impl: liger`` (or ``auto`` on CUDA with ``loss: ce`` when ``liger_kernel`` imports) runs
Liger's Triton kernel (``LigerFusedLinearCrossEntropyLoss``: logits, loss and gradients per
chunk, in one kernel) once per draft step on that step's ``[P, S+H]`` features, and combines the
per-step means into the drafter loss exactly (:func:`redraft.models.losses.drafter_loss`):

    loss = sum_i has_i / n_has * CE_mean_i * (learnable_i / valid_i)

(Liger averages over the rows it does not ignore -- the learnable ones, whose target is in the
draft vocabulary -- while the drafter loss divides by every valid row.) It has no KD term: KD
runs the torch ``fused`` implementation. Nothing here runs without CUDA.
"""

from __future__ import annotations

import importlib.util

import torch

from redraft.errors import ConfigError
from redraft.models.losses import IGNORE_INDEX, step_weights


def available() -> bool:
    """``liger_kernel`` is installed (its Triton kernels need CUDA)."""
    return importlib.util.find_spec("liger_kernel") is not None


def applies(cfg, device: torch.device) -> bool:
    """Liger's kernel computes this run's loss: CUDA and ``loss: ce``."""
    return device.type == "cuda" and cfg.loss == "ce"


def check(cfg, device: torch.device) -> None:
    """``--loss-impl liger`` can run here, else a ConfigError saying what to do."""
    if not applies(cfg, device):
        raise ConfigError(
            f"--loss-impl liger needs a CUDA device and --loss ce (here: device {device}, loss "
            f"{cfg.loss}); use --loss-impl fused (the chunked torch loss, any device, KD too).",
            param="loss_impl",
        )
    if not available():
        raise ConfigError(
            "--loss-impl liger needs the liger-kernel package: pip install liger-kernel "
            "(or use --loss-impl fused).",
            param="loss_impl",
        )


def _loss_fn():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="mean")


def liger_drafter_loss(
    features: torch.Tensor,
    weight: torch.Tensor,
    targets_draft: torch.Tensor,
    valid: torch.Tensor,
    step_decay: float = 1.0,
) -> tuple[torch.Tensor, dict]:
    """The drafter's CE loss of ``features @ weight.T`` through Liger's kernel.

    Args:
        features: ``[P, n, D]``; weight: ``[Vd, D]``; targets_draft: ``[P, n]`` (-1 outside the
            draft vocabulary); valid: ``[P, n]`` bool; step_decay: as in
            :func:`redraft.models.losses.drafter_loss`.

    Returns:
        ``(loss, stats)`` as :func:`redraft.models.losses.drafter_loss`.
    """
    fn = _loss_fn()
    weights, count = step_weights(valid, step_decay)  # [P, n], [n]
    learn = valid & (targets_draft >= 0)
    labels = torch.where(learn, targets_draft, IGNORE_INDEX)  # [P, n]
    per_step_w = weights.sum(0)  # [n]: has_i / n_has (times the step's decay factor)
    step_loss, loss = [], features.new_zeros((), dtype=torch.float32)
    for i in range(features.shape[1]):  # n <= 8 kernel calls, each over P rows
        mean_i = fn(weight, features[:, i].contiguous(), labels[:, i])
        # nan when nothing is learnable at step i: every row ignored
        mean_i = torch.nan_to_num(mean_i.float()) * learn[:, i].sum() / count[i].clamp(min=1)
        step_loss.append(mean_i.detach())
        loss = loss + per_step_w[i] * mean_i
    return loss, {"step_loss": torch.stack(step_loss), "step_count": count.detach()}
