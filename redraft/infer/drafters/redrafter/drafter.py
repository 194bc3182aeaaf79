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

from collections import Counter

import numpy as np
import torch

from redraft.infer.config import FIELDS
from redraft.infer.drafters.redrafter.beamcost import (
    MAX_SPLIT,
    MAX_WIDTH,
    RANK_BUCKETS,
    beam_group,
    measure_beam_cost,
    plan_beam,
    split_depth_np,
)
from redraft.infer.runner.graphs import ShapeGraphs
from redraft.infer.spec import hostjit
from redraft.infer.spec.drafter import DecodeState, Draft, Drafter


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


START_WIDTH = 8  # an "auto" width's first steps (before the decoder has measured anything)


class ReDrafterDrafter(Drafter):
    """Proposes the ``width`` beams of ``length`` tokens of a ReDrafter head.

    Args:
        head: a loaded :class:`~redraft.models.redrafter.ReDrafter` (``load_drafter``). It is cast
            to ``dtype`` in place.
        width: beams per row (Apple's default 4-8), or ``"auto"``: chosen every few steps from
            the measured drafting and verify costs and the observed acceptance by beam rank
            and depth (:mod:`redraft.infer.drafters.redrafter.beamcost`), among 1..``beamcost.MAX_WIDTH``.
        length: tokens per beam (<= the head's training horizon, ``head.config.num_steps``, the
            default, is where it is accurate), or ``"auto"``: chosen the same way among
            1..``num_steps``.
        dtype: the head's drafting dtype (:func:`draft_dtype`; ``"auto"``: bf16 on CPUs that
            multiply bf16 natively).
        beam_cost: a :class:`~redraft.infer.drafters.redrafter.beamcost.BeamCost` to use instead of measuring one
            at the first planned step (only with an ``"auto"`` width or length).
        graphs: replay the beam search from a CUDA graph per (rows, width, length)
            (:class:`~redraft.infer.runner.graphs.ShapeGraphs`; default: the head is on CUDA). Eager,
            its ~190 kernel launches a step cost milliseconds of host time.
        capture: the capture function (tests inject their own).

    "auto" needs the decoder's measurements: its
    :class:`~redraft.infer.spec.speculator.Speculator` calls :meth:`bind` with itself. Until it
    has a verify-cost curve (after its first step) the search runs at the default width and the
    head's horizon.
    """

    REPLAN = 4  # steps between two choices of (W, L) ("auto") while the choice moves
    # ... doubled after every plan that kept the last one, up to this: a plan of 80 candidates
    # is ~0.2 ms compiled (hostjit; ~15x that in numpy), so at every 4 steps it was
    # as much as the rest of a GPU step's host work; a settled choice is re-checked every 32
    # steps, and a change goes back to every 4
    MAX_REPLAN = 32
    SPLIT_EMA = 0.9  # weight of the past in the split-depth frequencies

    def __init__(
        self,
        head,
        width: int | str = FIELDS["redrafter_width"].default,
        length: int | str | None = FIELDS["redrafter_length"].default,
        name: str = "redrafter",
        dtype="auto",
        beam_cost=None,
        graphs: bool | None = None,
        capture=None,
    ):
        self.head, self.name = head.to(draft_dtype(head, dtype)), name
        device = next(self.head.parameters()).device
        self.graphs = ShapeGraphs(
            self._search, device, capture, graphs, name="ReDrafter beam search"
        )
        horizon = int(head.config.num_steps)  # the head's training horizon
        self.auto_width, self.auto_length = width == "auto", length == "auto"
        self.width = START_WIDTH if self.auto_width else int(width)
        self.length = horizon if self.auto_length or not length else int(length)
        self.widths = list(range(1, MAX_WIDTH + 1)) if self.auto_width else [self.width]
        self.lengths = list(range(1, horizon + 1)) if self.auto_length else [self.length]
        self.beam_cost = beam_cost
        # how often beam p splits from the beams before it at depth f; unseen: at depth 0
        self.split = np.zeros((max(self.widths), MAX_SPLIT + 1))
        self.split[:, 0] = 1
        self.plans: Counter = Counter()  # (W, L) -> steps drafted with it
        self._speculator, self._index, self._steps, self._next_plan = None, 0, 0, 0
        self._every = self.REPLAN  # steps to the next plan (grows while plans keep the choice)

    @property
    def auto(self) -> bool:
        return self.auto_width or self.auto_length

    def bind(self, speculator, index: int) -> None:
        """The speculator whose acceptance rates (``speculator.stats``, this drafter is
        ``index``), verify-cost curve and step timings an "auto" width or length is planned
        from."""
        self._speculator, self._index = speculator, index

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
        if self.auto and self._steps >= self._next_plan:
            before = (self.width, self.length)
            if self._plan(state):
                kept = (self.width, self.length) == before
                self._every = min(2 * self._every, self.MAX_REPLAN) if kept else self.REPLAN
                self._next_plan = self._steps + self._every
        self._steps += 1
        self.plans[(self.width, self.length)] += 1
        context = self.context(state.hidden)  # [B, H] (a multi head projects its layers)
        both = self.search(context, state.last, self.width, self.length).cpu()  # [B, W, 2L]
        tokens, logp = both[..., : self.length].long(), both[..., self.length :].float()
        if not self.auto:  # statistics by rank (the decoder's default)
            return Draft(tokens=tokens, logp=logp)
        return Draft(tokens=tokens, logp=logp, group=torch.from_numpy(self._groups(tokens.numpy())))

    def search(self, context: torch.Tensor, last: torch.Tensor, width: int, length: int):
        """The beam search of ``context [B, H]``, ``last [B]`` as one ``[B, W, 2L]`` float64
        tensor, the beams' target ids then their tokens' log-probs (one read to the host for
        both; ids < 2**53 and float32 log-probs are exact in float64). On CUDA it is replayed
        from a graph per shape (:attr:`graphs`): the tensor is valid until the next search."""
        key = (context.shape[0], width, length, context.dtype, last.dtype)
        return self.graphs(key, context, last)

    def _search(self, key, context: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        tokens, logp, _ = beam_search(self.head, context, last, key[1], key[2])
        return torch.cat([tokens.double(), logp.double()], dim=-1)

    def _groups(self, tokens: np.ndarray) -> np.ndarray:
        """``[B, W]`` the beams' statistics groups (rank bucket x split depth,
        :func:`~redraft.infer.drafters.redrafter.beamcost.beam_group`); this step's split depths are folded into
        the running frequencies."""
        B, W, _ = tokens.shape
        if hostjit.ENABLED:
            return hostjit._beam_groups(
                np.ascontiguousarray(tokens, np.int64),
                self.split[:W],
                self.SPLIT_EMA,
                MAX_SPLIT,
                RANK_BUCKETS,
            )
        f = np.minimum(split_depth_np(tokens), MAX_SPLIT)  # [B, W]
        seen = np.zeros((W, MAX_SPLIT + 1))
        np.add.at(seen, (np.broadcast_to(np.arange(W), (B, W)), f), 1.0 / B)
        a = self.SPLIT_EMA
        self.split[:W] = a * self.split[:W] + (1 - a) * seen
        return beam_group(np.arange(W)[None], f)

    def _plan(self, state: DecodeState) -> bool:
        """Choose (W, L) for the next steps (``beamcost.plan_beam``), measuring the beam-search
        cost on this device the first time; False while the decoder has no cost curve yet."""
        spec = self._speculator
        if spec is None or spec.cost_curve is None or state.hidden is None:
            return False
        if self.beam_cost is None:
            vd = self.head.config.draft_vocab_size or self.head.config.vocab_size
            self.beam_cost = measure_beam_cost(  # as decoding runs it (replayed on CUDA)
                self.search,
                self.context(state.hidden[:1]),
                state.last[:1],
                max_rows=min(vd, max(self.widths) * 4),
            )
        B = state.batch_size
        own = float(self.beam_cost(B, self.width, self.length))
        fixed = spec.draft_overhead - own  # the rest of the drafting phase
        rates = spec.stats.rates()[self._index]
        self.width, self.length, _ = plan_beam(
            rates, self.split, self.beam_cost, spec.cost_curve, B, self.widths, self.lengths, fixed
        )
        return True
