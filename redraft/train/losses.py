"""Teacher-forced training windows, the drafter loss, and held-out metrics.

Pairing (see :mod:`redraft.models.redrafter`): for every position ``t`` of a sequence at once,

    context = hidden[t]      tokens = ids[t+1 .. t+n]      targets = ids[t+2 .. t+n+1]

Step ``i`` predicts ``ids[t+2+i]``; it counts when ``loss_mask[t+2+i] == 1`` (an assistant token).
The target's own prediction for that token is ``argmax(lm_head(hidden[t+1+i]))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The loss lives with the head (ReDrafter.forward(labels=...) uses it too); re-exported here.
from redraft.models.losses import IGNORE_INDEX as IGNORE  # noqa: F401
from redraft.models.losses import drafter_loss  # noqa: F401


@dataclass
class Windows:
    """The selected positions of a batch, P of them, each with its n-step chain.

    Attributes:
        batch_idx, pos_idx: ``[P]`` where each window starts (its context is ``hidden[b, t]``).
        tokens: ``[P, n]`` target ids fed to the drafter, ``ids[t+1 .. t+n]``.
        targets: ``[P, n]`` target ids to predict, ``ids[t+2 .. t+n+1]``.
        valid: ``[P, n]`` bool, the target is an assistant token inside the sequence.
        kd_valid: ``[P, n]`` bool, the target is a KD position (:func:`make_windows`'s
            ``kd_mask``), or None: the KD term counts where ``valid`` does.
    """

    batch_idx: torch.Tensor
    pos_idx: torch.Tensor
    tokens: torch.Tensor
    targets: torch.Tensor
    valid: torch.Tensor
    kd_valid: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.batch_idx.numel())


def _windows_of(x: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """``x`` [B, T] -> ``[B, T, n+1]`` with ``out[b, t] = x[b, t+1 .. t+n+1]`` (``fill`` past the end)."""
    B, T = x.shape
    padded = torch.cat([x[:, 1:], x.new_full((B, n + 1), fill)], dim=1)  # [B, T+n]
    return padded.unfold(1, n + 1, 1)[:, :T]  # [B, T, n+1] (a view, no copy)


def _target_masks(loss_mask: torch.Tensor, n: int, kd_mask: torch.Tensor | None):
    """``[B, T, n]`` windows of the cross-entropy targets and of the KD targets (or None)."""
    m_w = _windows_of(loss_mask.to(torch.bool), n, fill=False)[..., 1:]
    kd_w = None
    if kd_mask is not None:
        kd_w = _windows_of(kd_mask.to(torch.bool), n, fill=False)[..., 1:] | m_w
    return m_w, kd_w


def learn_positions(
    loss_mask: torch.Tensor, n: int, kd_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b [P], t [P])``: the positions whose window has something to learn (see
    :func:`make_windows`). ``nonzero`` needs the count on the host: computed from the CPU copy
    of a batch (``Batch.host``) it costs the device no wait."""
    m_w, kd_w = _target_masks(loss_mask, n, kd_mask)
    return (m_w if kd_w is None else kd_w).any(-1).nonzero(as_tuple=True)


def make_windows(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    n: int,
    kd_mask: torch.Tensor | None = None,
    positions: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Windows:
    """All teacher-forcing windows of a batch that have at least one assistant target (or, with
    ``kd_mask``, at least one KD target).

    Args:
        input_ids: ``[B, T]`` token ids (right padded).
        loss_mask: ``[B, T]`` 1 on assistant tokens, 0 elsewhere and on padding.
        n: the horizon (drafter steps).
        kd_mask: ``[B, T]`` 1 on the tokens the KD term learns (``kd_positions: all``: every real
            token, 0 on padding), or None (the KD term follows ``loss_mask``).
        positions: :func:`learn_positions` of the same masks, already on ``input_ids``' device
            (from the batch's CPU copy), or None: found here (a host sync on CUDA).
    """
    ids_w = _windows_of(input_ids, n)  # [B, T, n+1]: ids[t+1 .. t+n+1]
    m_w, kd_w = _target_masks(loss_mask, n, kd_mask)  # [B, T, n]: masks of the targets
    if positions is None:
        learn = m_w if kd_w is None else kd_w
        positions = learn.any(-1).nonzero(as_tuple=True)  # [P] positions with something to learn
    b, t = positions
    w = ids_w[b, t]  # [P, n+1]
    return Windows(
        batch_idx=b,
        pos_idx=t,
        tokens=w[:, :n].contiguous(),
        targets=w[:, 1:].contiguous(),
        valid=m_w[b, t],
        kd_valid=None if kd_w is None else kd_w[b, t],
    )


def real_token_mask(input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` 1 on each row's first ``lengths[b]`` tokens (the real ones), 0 on padding."""
    return (
        torch.arange(input_ids.shape[1], device=input_ids.device)
        < lengths.to(input_ids.device)[:, None]
    )


def target_next_positions(win: Windows, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``(b [P, n], j [P, n])`` of the hidden states whose LM-head output predicts each target
    (``j = t+1+i``, clamped inside the sequence; clamped entries are never valid)."""
    n = win.tokens.shape[1]
    j = (win.pos_idx[:, None] + 1 + torch.arange(n, device=win.pos_idx.device)).clamp(
        max=seq_len - 1
    )
    return win.batch_idx[:, None].expand_as(j), j


class EvalAccumulator:
    """Sums of per-position counts over many batches (all_reduce-able as one tensor).

    For each step i: valid targets, top-1 / top-5 hits against the data, top-1 / top-5 hits
    against the target's greedy token, summed loss; chain counts for k = 1..n.

    Chains (the first k steps all right) count from the positions whose step 0 is valid:
      * ``chain_data``: top-1 equals the data token at steps 0..k-1;
      * ``chain_target``: top-1 equals the target's greedy token AND the data token equals it
        (so the teacher-forced inputs are exactly what a greedy decode would feed) at steps
        0..k-1. This simulates greedy speculative decoding with one top-1 chain; it is a lower
        bound where the data is not the target's own greedy output.
    ``tau_est = 1 + sum_k chain_acc_k`` (expected tokens per target call with one chain).
    """

    def __init__(self, n: int, device=None):
        self.n = n
        # rows: valid, top1, top5, top1_t, top5_t, loss_sum, chain_data, chain_target; + [starts]
        self.sums = torch.zeros(8, n, dtype=torch.float64, device=device)
        self.starts = torch.zeros(1, dtype=torch.float64, device=device)

    @torch.no_grad()
    def add(
        self,
        logits: torch.Tensor,
        targets_draft: torch.Tensor,
        greedy_draft: torch.Tensor,
        data_is_greedy: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        """``logits`` [P, n, Vd]; ``targets_draft``, ``greedy_draft`` [P, n] draft ids (-1 = none);
        ``data_is_greedy`` [P, n] bool (data token == target greedy token); ``valid`` [P, n]."""
        top5 = logits.topk(min(5, logits.shape[-1]), dim=-1).indices  # [P, n, 5]
        top1 = top5[..., 0]
        hit1 = (top1 == targets_draft) & valid
        hit5 = (top5 == targets_draft[..., None]).any(-1) & valid
        hit1_t = (top1 == greedy_draft) & (greedy_draft >= 0) & valid
        hit5_t = (top5 == greedy_draft[..., None]).any(-1) & (greedy_draft >= 0) & valid
        ce_valid = valid & (targets_draft >= 0)
        nll = (
            -logits.float()
            .log_softmax(-1)
            .gather(-1, targets_draft.clamp(min=0)[..., None])
            .squeeze(-1)
        )
        chain_d = hit1.long().cumprod(1)  # [P, n]: 1 while every step so far was right
        chain_t = (hit1_t & data_is_greedy).long().cumprod(1)
        start = valid[:, 0]
        rows = torch.stack([valid, hit1, hit5, hit1_t, hit5_t]).double().sum(1)  # [5, n]
        self.sums[:5] += rows
        self.sums[5] += (nll * ce_valid).double().sum(0)
        self.sums[6] += (chain_d * start[:, None]).double().sum(0)
        self.sums[7] += (chain_t * start[:, None]).double().sum(0)
        self.starts += start.double().sum()

    def as_tensor(self) -> torch.Tensor:
        return torch.cat([self.sums.flatten(), self.starts])

    def load_tensor(self, t: torch.Tensor) -> None:
        self.sums.copy_(t[:-1].view_as(self.sums))
        self.starts.copy_(t[-1:])

    def result(self) -> dict:
        s, starts = self.sums.cpu(), float(self.starts.item())
        valid = s[0].clamp(min=1)
        chain_d = (s[6] / max(starts, 1.0)).tolist()
        chain_t = (s[7] / max(starts, 1.0)).tolist()
        return {
            "eval_positions": int(starts),
            "eval_loss": float(s[5].sum() / valid.sum()),
            "eval_step_loss": (s[5] / valid).tolist(),
            "eval_top1": (s[1] / valid).tolist(),
            "eval_top5": (s[2] / valid).tolist(),
            "eval_top1_target": (s[3] / valid).tolist(),
            "eval_top5_target": (s[4] / valid).tolist(),
            "eval_chain_acc": chain_t,
            "eval_chain_acc_data": chain_d,
            "eval_tau_est": 1.0 + sum(chain_t),
            "eval_tau_est_data": 1.0 + sum(chain_d),
        }
