"""How wide and how long a ReDrafter beam search should be: measured cost against observed gain.

A beam search of width W and length L costs one head step over the batch's B rows, then L - 1
steps over its B * W beams (``drafters.redrafter.beam_search``)::

    draft(B, W, L) = first(B) + (L - 1) * ext(B * W)

``first`` and ``ext`` are piecewise-linear curves over rows (:class:`~redraft.infer.budget.CostCurve`),
measured once on the device in use (:func:`measure_beam_cost`, like the verify-cost curve).

What a beam buys: the decoder observes, per (drafter, path group, depth), how often an entry
is accepted once its parent was; the ReDrafter's paths are grouped by beam rank, so
``v[p, l] = prod_{j <= l} rate[p, j]`` is the chance that beam ``p`` is accepted through depth
``l``. Beams share prefixes and at most one node per depth is accepted, so those events are
either the same (a shared node) or disjoint: the chance that the accepted path reaches depth
``l + 1`` is the sum of ``v`` over the *distinct* nodes at depth ``l``. The drafter counts how
often entry ``(p, l)`` is a node of its own (``novelty[p, l]``, :func:`novelty_np`), so a
(W, L) tree holds, in expectation, ``novelty[p, l]`` nodes of value ``v[p, l]`` for every
``p < W``, ``l < L`` (the sum at a depth capped by the depth above it: the accepted path cannot
reach depth l + 1 more often than depth l). Beams are sorted by score, so a beam's ``v`` is
taken as at most the beam's above it: a rank never tried does not look better than the ranks
that were (its rates alone would be the prior's).

:func:`plan_beam` then does what ``budget.best_budget`` does for the tree, one level up: for
every candidate (W, L) it sorts those nodes by value, lets the budget verify the best K of them,
and scores ``B * (1 + sum of the K values) / (c(B * (K + 1)) + draft(B, W, L) + fixed)``: the
expected output tokens per second of the step. The best (W, L) wins. Depths never tried keep
the rates' prior (0.3), so longer searches look worth a try until tried; the decoder's counts
decay, so an abandoned setting is re-tried now and then.

Worked example (B = 1, every entry a node of its own, a flat verify cost of 1 s, drafting
``first(1) = ext(1) = 0.1`` s and ``ext(2) = 0.15`` s): rates ``[[0.6, 0.5], [0.2, 0.5]]`` give
``v = [[0.6, 0.3], [0.2, 0.1]]``, so

    W=1, L=1: (1 + 0.6) / (1 + 0.1)                   = 1.45 tokens/s
    W=1, L=2: (1 + 0.6 + 0.3) / (1 + 0.1 + 0.1)       = 1.58
    W=2, L=1: (1 + 0.6 + 0.2) / (1 + 0.1)             = 1.64
    W=2, L=2: (1 + 0.6 + 0.3 + 0.2 + 0.1) / (1 + 0.1 + 0.15) = 1.76   <- chosen

Everything here is numpy on the host, from numbers the host already has: no device work.
"""

from __future__ import annotations

import numpy as np
import torch

from redraft.infer.budget import CostCurve, measure_cost_curve

ROW_SIZES = (1, 2, 4, 8, 16, 32, 64)  # rows at which the head's steps are timed
MAX_WIDTH = 16  # the widest beam search "auto" considers


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


def curve_np(curve: CostCurve, n) -> np.ndarray:
    """``curve(n)`` in numpy for any float ``n`` (``CostCurve.__call__``: piecewise linear,
    linear past the last point, never below the first point's cost)."""
    x, y = curve.sizes.numpy(), curve.seconds.numpy()
    n = np.asarray(n, np.float64)
    if len(x) == 1:
        return np.full_like(n, y[0])
    out = np.interp(n, x, y)
    slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
    out = np.where(n > x[-1], y[-1] + (n - x[-1]) * slope, out)
    return np.maximum(out, y[0])


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
        lambda n: search(context.expand(n, -1), last.expand(n), 1, 1), sizes, repeats, sync
    )
    full = measure_cost_curve(lambda n: search(context, last, n, 1 + steps), sizes, repeats, sync)
    f1 = float(first.seconds[0])
    ext = (full.seconds - f1).clamp(min=1e-7) / steps  # [sizes]
    return BeamCost(first, CostCurve(sizes, ext.cummax(dim=0).values.tolist()))


def novelty_np(tokens: np.ndarray) -> np.ndarray:
    """``[W, L]`` float: the fraction of rows in which beam ``p``'s entry at depth ``l`` is a
    node of its own (no beam before it shares its prefix through depth ``l``), for beams
    ``tokens [B, W, L]`` (host ids; beam 0 is always new)."""
    B, W, L = tokens.shape
    eq = tokens[:, :, None, :] == tokens[:, None, :, :]  # [B, W(p), W(q), L]
    shared = np.logical_and.accumulate(eq, axis=-1)  # prefixes equal through depth l
    earlier = np.tri(W, W, -1, dtype=bool)[None, :, :, None]  # q < p
    return (~(shared & earlier).any(axis=2)).mean(axis=0)


def plan_beam(
    rates: np.ndarray,
    novelty: np.ndarray,
    beam_cost: BeamCost,
    verify_cost: CostCurve,
    batch: int,
    widths,
    lengths,
    fixed_s: float = 0.0,
) -> tuple[int, int, float]:
    """The (W, L) with the most expected output tokens per second (see the module doc).

    Args:
        rates: ``[G, D]`` acceptance rate of the ReDrafter's entries by beam rank and depth
            (``HostStats.rates()[drafter]``; the last rank and depth stand for those past them).
        novelty: ``[max(widths), max(lengths)]`` expected new nodes per entry (:func:`novelty_np`).
        beam_cost: the drafting cost; verify_cost: the decoder's verify-cost curve (one row).
        batch: rows B. widths, lengths: the candidates. fixed_s: other per-step seconds.

    Returns:
        ``(W, L, tokens per second)`` of the best candidate.
    """
    Wm, Lm = max(widths), max(lengths)
    rates = np.asarray(rates, np.float64)[:Wm, :Lm]
    # past the statistics' last rank or depth the decoder reuses the last one: so does the plan
    rates = np.pad(rates, ((0, Wm - rates.shape[0]), (0, Lm - rates.shape[1])), mode="edge")
    v = np.cumprod(rates, axis=1)  # [Wm, Lm]
    v = np.minimum.accumulate(v, axis=0)  # a lower-scored beam is no likelier (untried ranks)
    new = np.asarray(novelty, np.float64)[:Wm, :Lm]
    cand = np.array([(w, n) for w in widths for n in lengths], np.int64)  # [C, 2]
    Wc, Lc = cand[:, 0], cand[:, 1]
    rank, depth = np.arange(Wm), np.arange(Lm)
    inside = (rank[None, :, None] < Wc[:, None, None]) & (depth[None, None, :] < Lc[:, None, None])
    weight = np.where(inside, new[None], 0.0)  # [C, Wm, Lm] expected nodes per entry
    # the accepted path reaches depth l+1 no more often than depth l: scale each depth's nodes
    depth_sum = (weight * v[None]).sum(axis=1)  # [C, Lm]
    cap = np.minimum.accumulate(np.minimum(depth_sum, 1.0), axis=1)
    weight = weight * np.where(depth_sum > 0, cap / np.maximum(depth_sum, 1e-12), 0.0)[:, None]
    order = np.argsort(-v, axis=None, kind="stable")  # nodes by value, best first
    w_sorted = weight.reshape(len(cand), -1)[:, order]  # [C, Wm*Lm]
    zero = np.zeros((len(cand), 1))
    nodes = np.concatenate([zero, np.cumsum(w_sorted, axis=1)], axis=1)  # K = 0.. [C, G+1]
    gain = np.concatenate([zero, np.cumsum(w_sorted * v.reshape(-1)[order], axis=1)], axis=1)
    secs = (
        curve_np(verify_cost, batch * (1 + nodes))
        + beam_cost(batch, Wc, Lc)[:, None]
        + max(fixed_s, 0.0)
    )
    tps = (batch * (1 + gain) / secs).max(axis=1)  # the budget's best K per candidate
    best = int(np.argmax(tps))
    return int(Wc[best]), int(Lc[best]), float(tps[best])
