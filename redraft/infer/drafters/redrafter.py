"""The ReDrafter drafter: beam search with the recurrent draft head (Zhang et al., Apple 2024).

Beam search, vectorised over batch x beams (Apple's reference does the same)::

    step 0:  s_0, logits = head.step(None, x, y)          x: target hidden [B, H], y: bonus [B]
             top-W of log_softmax(logits)              -> W beams of one token each
    step l:  s_l, logits = head.step(s_{l-1}, x, beam's last token)      [B*W, Vd]
             score[b, w, v] = beam score + log p(v)    -> top-W over W*Vd: (parent beam, token)
             gather parents' states and tokens

The result is W beams of L tokens ([B, W, L]) sorted by score, and each token's draft
log-probability. Beams share prefixes; the decoder's tree stores them once. Beams are chosen
deterministically (top-W, not sampled); the decoder verifies every candidate as a point mass,
which keeps the target's distribution exactly.
"""

from __future__ import annotations

import torch

from redraft.infer.config import FIELDS
from redraft.infer.drafters.base import DecodeState, Draft, Drafter


@torch.no_grad()
def beam_search(head, context: torch.Tensor, last: torch.Tensor, width: int, length: int):
    """ReDrafter beam search.

    Args:
        head: a :class:`redraft.models.redrafter.ReDrafter` (``step``, ``to_target_ids``).
        context: ``[B, H]`` target hidden state at the position that produced ``last``.
        last: ``[B]`` the bonus token (target id).
        width: beams W; length: tokens per beam L.

    Returns:
        ``(tokens [B, W, L] target ids, logp [B, W, L] per-token draft log-probs,
        score [B, W] beam log-probs)``, beams sorted by score.

    The W best extensions of W beams are among the top W tokens of each beam, so each step takes
    the top W of every beam's logits (``[B*W, W]``) and then the best W of those ``W*W``
    candidates; the normaliser of each beam is one ``logsumexp``: no ``[B, W*Vd]`` scores and no
    full log-softmax are written. Everything stays on the device (no host reads).
    """
    B = last.shape[0]
    dtype = next(head.parameters()).dtype
    ctx = context.to(dtype)
    state, logits = head.step(None, ctx, last)  # [B, S], [B, Vd]
    Vd = logits.shape[-1]
    W = min(width, Vd)
    top, tok = logits.topk(W, dim=-1)  # [B, W]
    score = top.float() - logits.float().logsumexp(-1, keepdim=True)  # [B, W] log-probs
    draft_ids = tok[:, :, None]  # [B, W, 1] draft-vocab ids
    tok_logp = score[:, :, None]
    state = state.repeat_interleave(W, dim=0)  # [B*W, S]
    ctx_w = ctx.repeat_interleave(W, dim=0)  # [B*W, H]
    rows = torch.arange(B, device=last.device)[:, None]
    for _ in range(1, length):
        last_t = head.to_target_ids(draft_ids[:, :, -1]).reshape(B * W)
        state, logits = head.step(state, ctx_w, last_t)  # [B*W, Vd]
        top, cand = logits.topk(W, dim=-1)  # [B*W, W]: each beam's best W tokens
        lp = (top.float() - logits.float().logsumexp(-1, keepdim=True)).view(B, W, W)
        score, flat = (score[:, :, None] + lp).view(B, W * W).topk(W, dim=-1)  # [B, W]
        parent, k = flat // W, flat % W
        tok = cand.view(B, W, W)[rows, parent, k]  # [B, W] draft ids
        draft_ids = torch.cat([draft_ids[rows, parent], tok[:, :, None]], dim=2)
        tok_logp = torch.cat([tok_logp[rows, parent], lp[rows, parent, k][:, :, None]], dim=2)
        state = state.view(B, W, -1)[rows, parent].reshape(B * W, -1)
    return head.to_target_ids(draft_ids), tok_logp, score


def native_bf16_cpu() -> bool:
    """This CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): a bf16 head drafts ~3-4x faster
    than a float32 one there (docs/infer.md)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without these probes
        return False


def draft_dtype(head, dtype="auto") -> torch.dtype:
    """The dtype the head drafts in. ``"auto"``: bfloat16 for a float32 head on a CPU with native
    bf16 (drafts are only proposals: the target verifies every token, so the output is the same),
    else the head's own dtype."""
    own = next(head.parameters())
    if dtype != "auto":
        return dtype
    if own.dtype == torch.float32 and own.device.type == "cpu" and native_bf16_cpu():
        return torch.bfloat16
    return own.dtype


class ReDrafterDrafter(Drafter):
    """Proposes the ``width`` beams of ``length`` tokens of a ReDrafter head.

    Args:
        head: a loaded :class:`~redraft.models.redrafter.ReDrafter` (``load_drafter``). It is cast
            to ``dtype`` in place.
        width: beams per row (Apple's default 4-8). length: tokens per beam (<= the head's
            training horizon, ``head.config.num_steps``, the default, is where it is accurate).
        dtype: the head's drafting dtype (:func:`draft_dtype`; ``"auto"``: bf16 on CPUs that
            multiply bf16 natively).
    """

    def __init__(
        self,
        head,
        width: int = FIELDS["redrafter_width"].default,
        length: int | None = None,
        name: str = "redrafter",
        dtype="auto",
    ):
        self.head, self.width, self.name = head.to(draft_dtype(head, dtype)), width, name
        self.length = int(length or head.config.num_steps)  # default: the head's training horizon

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states the head reads, the last one last (``()``: a
        ``last`` head, the last hidden state only). The decoder has the verify forward return
        them, concatenated, as ``DecodeState.hidden``."""
        return self.head.config.hidden_layers

    def context(self, hidden: torch.Tensor) -> torch.Tensor:
        """``state.hidden`` ``[B, F]`` -> the head's context ``x`` ``[B, H]``, once per step: a
        ``last`` head takes the last H columns (all of them unless a multi-layer head shares
        the decoder), a ``multi`` head projects its layers' states (``head.project``)."""
        if self.hidden_layers:
            return self.head.project(hidden)
        H = self.head.config.hidden_size
        return hidden if hidden.shape[-1] == H else hidden[..., -H:]

    def propose(self, state: DecodeState) -> Draft:
        context = self.context(state.hidden)
        tokens, logp, _ = beam_search(self.head, context, state.last, self.width, self.length)
        return Draft(tokens=tokens.to(state.device), logp=logp.to(state.device))
