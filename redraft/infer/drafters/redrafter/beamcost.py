"""How wide and how long a ReDrafter beam search should be: measured cost against observed gain.

A beam search of width W and length L costs one head step over the batch's B rows, then L - 1
steps over its B * W beams (``drafters.redrafter.beam_search``)::

    draft(B, W, L) = first(B) + (L - 1) * ext(B * W)

``first`` and ``ext`` are piecewise-linear curves over rows (:class:`~redraft.infer.runner.cost.CostCurve`),
measured once on the device in use (:func:`measure_beam_cost`, like the verify-cost curve).

What a beam buys: the decoder observes, per (drafter, path group, depth), how often an entry
is accepted once its parent was. Beams share prefixes, and a beam's entries on a prefix it
shares with a better beam are that beam's nodes, not new ones; so an "auto" drafter puts each
beam in the group of its rank bucket (0, 1, 2-3, 4-7, 8+) and its *split depth* ``f``, the first
depth at which it differs from every beam before it (:func:`split_depth_np`; beam 0 and beams
with a first token of their own: 0). Then ``v[p, f, l] = prod_{j <= l} rate[group(p, f), j]``
is the chance that such a beam is accepted through depth ``l``, and its new nodes are the
depths ``l >= f``. At most one node per depth is accepted, so distinct nodes are disjoint
events: the chance that the accepted path reaches depth ``l + 1`` is the sum of ``v`` over the
distinct nodes at depth ``l``. The drafter counts how often beam ``p`` splits at ``f``
(``split[p, f]``), so a (W, L) tree holds, in expectation, ``split[p, f]`` nodes of value
``v[p, f, l]`` for every ``p < W``, ``f <= l < L`` (each depth's sum capped by the depth above
it: the accepted path cannot reach depth l + 1 more often than depth l). Beams are sorted by
score, so a beam's ``v`` is taken as at most the beam's above it with the same split: a rank
never tried does not look better than the ranks that were (its rates alone would be the
prior's).

:func:`plan_beam` then does what ``spec.hoststats.best_budget_np`` does for the tree, one level up: for
every candidate (W, L) it sorts those nodes by value, lets the budget verify the best K of them,
and scores ``B * (1 + sum of the K values) / (c(B * (K + 1)) + draft(B, W, L) + fixed)``: the
expected output tokens per second of the step. The best (W, L) wins. Depths never tried keep
the rates' prior (0.3), so longer searches look worth a try until tried; the decoder's counts
decay, so an abandoned setting is re-tried now and then.

Worked example (B = 1, both beams split at depth 0, a flat verify cost of 1 s, drafting
``first(1) = ext(1) = 0.1`` s and ``ext(2) = 0.15`` s): rates ``[0.6, 0.5]`` (beam 0) and
``[0.2, 0.5]`` (beam 1) give ``v = [[0.6, 0.3], [0.2, 0.1]]``, so

    W=1, L=1: (1 + 0.6) / (1 + 0.1)                   = 1.45 tokens/s
    W=1, L=2: (1 + 0.6 + 0.3) / (1 + 0.1 + 0.1)       = 1.58
    W=2, L=1: (1 + 0.6 + 0.2) / (1 + 0.1)             = 1.64
    W=2, L=2: (1 + 0.6 + 0.3 + 0.2 + 0.1) / (1 + 0.1 + 0.15) = 1.76   <- chosen

Everything here runs on the host, from numbers the host already has: no device work (the plan
and the beams' groups in numba-compiled loops, :mod:`redraft.infer.spec.hostjit`, where numba is
installed; this numpy code otherwise).
"""

from __future__ import annotations

import numpy as np
import torch

from redraft.infer.runner.cost import CostCurve, curve_np, measure_cost_curve
from redraft.infer.spec import hostjit

ROW_SIZES = (1, 2, 4, 8, 16, 32, 64)  # rows at which the head's steps are timed
MAX_WIDTH = 16  # the widest beam search "auto" considers
RANK_BUCKETS = 5  # statistics groups per split depth: ranks 0, 1, 2-3, 4-7, 8+
MAX_SPLIT = 5  # split depths 0..5 (deeper ones counted as 5): 30 groups, within HostStats' 32


def rank_bucket(rank) -> np.ndarray:
    """Ranks 0, 1, 2-3, 4-7, 8+ -> buckets 0, 1, 2, 3, 4 (``ceil(log2(rank + 1))``, capped)."""
    rank = np.asarray(rank, np.int64)
    return np.minimum(np.ceil(np.log2(rank + 1.0)), RANK_BUCKETS - 1).astype(np.int64)


def beam_group(rank, split) -> np.ndarray:
    """The statistics group of a beam of ``rank`` that splits at depth ``split`` (broadcast)."""
    return np.minimum(np.asarray(split, np.int64), MAX_SPLIT) * RANK_BUCKETS + rank_bucket(rank)


class BeamCost:
    """``draft(B, W, L) = first(B) + (L - 1) * ext(B * W)`` seconds (see the module doc)."""

    def __init__(self, first: CostCurve, ext: CostCurve):
        self.first, self.ext = first, ext

    def __call__(self, batch: int, width, length) -> np.ndarray:
        """Seconds of beam searches of ``width`` x ``length`` (arrays broadcast) over ``batch`` rows."""
        width, length = np.asarray(width, np.float64), np.asarray(length, np.float64)
        f = curve_np(self.first, np.float64(batch))
        return f + (length - 1) * curve_np(self.ext, batch * width)

    def to_dict(self) -> dict:
        return {"first": self.first.to_dict(), "ext": self.ext.to_dict()}

    @classmethod
    def from_ms(cls, first, ext) -> BeamCost:
        """From two ``CostCurve.from_ms`` specs (``"rows:ms,rows:ms"`` or dicts)."""
        return cls(CostCurve.from_ms(first), CostCurve.from_ms(ext))


@torch.no_grad()
def measure_beam_cost(
    search, context: torch.Tensor, last: torch.Tensor, max_rows: int, steps: int = 2, repeats=3
) -> BeamCost:
    """Time the head's beam search on this device.

    Args:
        search: ``search(context [n, H], last [n], width, length)`` runs one beam search.
        context, last: one row's target hidden state ``[1, H]`` and bonus token ``[1]``.
        max_rows: the most rows to time (the draft vocabulary, or more than any plan needs).
        steps: extension steps per timed search (their mean is ``ext``).

    ``first(n)``: a search of width 1 and length 1 over n rows; ``ext(n)``: (a search of width
    n, length ``1 + steps`` over one row - ``first(1)``) / ``steps``. The fastest of
    ``repeats`` runs each (other processes only ever add time).
    """
    sync = torch.cuda.synchronize if context.device.type == "cuda" else None
    sizes = [n for n in ROW_SIZES if n <= max_rows] or [1]
    first = measure_cost_curve(
        lambda n: search(context.expand(n, -1), last.expand(n), 1, 1),
        sizes,
        repeats,
        sync,
        padded=False,
    )
    full = measure_cost_curve(
        lambda n: search(context, last, n, 1 + steps), sizes, repeats, sync, padded=False
    )
    f1 = float(first.seconds[0])
    ext = (full.seconds - f1).clamp(min=1e-7) / steps  # [sizes]
    return BeamCost(first, CostCurve(sizes, ext.cummax(dim=0).values.tolist()))


def split_depth_np(tokens: np.ndarray) -> np.ndarray:
    """``[B, W]`` int64: the first depth at which beam ``p`` of ``tokens [B, W, L]`` differs from
    every beam before it (the length of its longest prefix shared with a better beam; beam 0:
    0). Beams are distinct sequences, so it is below ``L``."""
    B, W, L = tokens.shape
    eq = tokens[:, :, None, :] == tokens[:, None, :, :]  # [B, W(p), W(q), L]
    common = np.logical_and.accumulate(eq, axis=-1).sum(axis=-1)  # [B, W, W] shared prefix
    earlier = np.tri(W, W, -1, dtype=bool)[None]  # q < p
    return np.where(earlier, common, 0).max(axis=2, initial=0)


def plan_beam(
    rates: np.ndarray,
    split: np.ndarray,
    beam_cost: BeamCost,
    verify_cost: CostCurve,
    batch: int,
    widths,
    lengths,
    fixed_s: float = 0.0,
) -> tuple[int, int, float]:
    """The (W, L) with the most expected output tokens per second (see the module doc).

    Args:
        rates: ``[G, D]`` acceptance rate of the ReDrafter's entries by statistics group
            (:func:`beam_group`) and depth (``HostStats.rates()[drafter]``; the last depth
            stands for those past it).
        split: ``[max(widths), S]``: how often beam ``p`` splits at depth ``f`` (rows sum to 1;
            ``S <= MAX_SPLIT + 1``).
        beam_cost: the drafting cost; verify_cost: the decoder's verify-cost curve (one row).
        batch: rows B. widths, lengths: the candidates. fixed_s: other per-step seconds.

    Returns:
        ``(W, L, tokens per second)`` of the best candidate.
    """
    if hostjit.ENABLED:  # the same arithmetic compiled (~1 ms of numpy a plan otherwise)
        widths, lengths = np.asarray(widths, np.int64), np.asarray(lengths, np.int64)
        Wc, Lc = np.repeat(widths, len(lengths)), np.tile(lengths, len(widths))
        best, tps = hostjit._plan_beam(
            np.ascontiguousarray(rates, np.float64),
            np.ascontiguousarray(split, np.float64),
            widths,
            lengths,
            verify_cost.sizes.numpy(),
            verify_cost.seconds.numpy(),
            np.asarray(beam_cost(batch, Wc, Lc), np.float64).reshape(-1),
            float(batch),
            float(fixed_s),
            MAX_SPLIT,
            RANK_BUCKETS,
        )
        return int(Wc[best]), int(Lc[best]), float(tps)
    Wm, Lm = max(widths), max(lengths)
    split = np.asarray(split, np.float64)[:Wm]
    S = split.shape[1]
    rates = np.asarray(rates, np.float64)[:, :Lm]
    rates = np.pad(rates, ((0, 0), (0, Lm - rates.shape[1])), mode="edge")  # the decoder's rule
    rank, f, depth = np.arange(Wm), np.arange(S), np.arange(Lm)
    v = np.cumprod(rates[beam_group(rank[:, None], f[None])], axis=2)  # [Wm, S, Lm]
    # a lower-scored beam is no likelier (untried ranks); beam 0 only ever splits at depth 0
    v[:, 0] = np.minimum.accumulate(v[:, 0], axis=0)
    v[1:, 1:] = np.minimum.accumulate(v[1:, 1:], axis=0)
    cand = np.array([(w, n) for w in widths for n in lengths], np.int64)  # [C, 2]
    Wc, Lc = cand[:, 0], cand[:, 1]
    inside = (rank[None, :, None, None] < Wc[:, None, None, None]) & (
        depth[None, None, None, :] < Lc[:, None, None, None]
    )
    new = split[:, :, None] * (depth[None, None, :] >= f[None, :, None])  # [Wm, S, Lm] nodes
    weight = np.where(inside, new[None], 0.0)  # [C, Wm, S, Lm] expected nodes per entry
    # the accepted path reaches depth l+1 no more often than depth l: scale each depth's nodes
    depth_sum = (weight * v[None]).sum(axis=(1, 2))  # [C, Lm]
    cap = np.minimum.accumulate(np.minimum(depth_sum, 1.0), axis=1)
    scale = np.where(depth_sum > 0, cap / np.maximum(depth_sum, 1e-12), 0.0)
    weight = weight * scale[:, None, None, :]
    order = np.argsort(-v, axis=None, kind="stable")  # nodes by value, best first
    w_sorted = weight.reshape(len(cand), -1)[:, order]  # [C, Wm*S*Lm]
    zero = np.zeros((len(cand), 1))
    nodes = np.concatenate([zero, np.cumsum(w_sorted, axis=1)], axis=1)  # K = 0.. [C, N+1]
    gain = np.concatenate([zero, np.cumsum(w_sorted * v.reshape(-1)[order], axis=1)], axis=1)
    secs = (
        curve_np(verify_cost, batch * (1 + nodes))
        + beam_cost(batch, Wc, Lc)[:, None]
        + max(fixed_s, 0.0)
    )
    tps = (batch * (1 + gain) / secs).max(axis=1)  # the budget's best K per candidate
    best = int(np.argmax(tps))
    return int(Wc[best]), int(Lc[best]), float(tps[best])
