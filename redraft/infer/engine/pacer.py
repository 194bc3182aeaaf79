"""How large a prefill piece may be: the "auto" chunk (:func:`prefill_chunk`, read off the
verify-cost curve) and :class:`PrefillPacer` (fitted to the prefill forwards it timed), so a
joining prompt stalls the running rows by about its share of a step.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np
import torch

from redraft.infer.runner.cost import CostCurve, curve_np

PREFILL_CHUNK_MIN, PREFILL_CHUNK_MAX = 16, 2048  # the "auto" prefill chunk's bounds (tokens)


def prefill_chunk(cost: CostCurve, step_tokens: int) -> int:
    """The "auto" chunked-prefill size: the largest multiple of 16 in
    ``[PREFILL_CHUNK_MIN, PREFILL_CHUNK_MAX]`` whose forward costs no more than the running rows'
    verify forward of ``step_tokens`` tokens (batch x tree size), read off the cost curve. Past
    the curve's last measured size the cost is taken as proportional to the tokens (a bound:
    the last measured segment's slope is noise on a flat curve, and a forward of thousands of
    tokens is never flat). A step that also prefills a chunk then takes at most about twice a
    plain step, so a joining prompt never stalls the running streams for longer than that.
    ``step_tokens == 0`` (no row decodes: nobody to stall) gives the maximum."""
    if step_tokens <= 0:
        return PREFILL_CHUNK_MAX
    last, c_last = float(cost.sizes[-1]), float(cost.seconds[-1])

    def c(n):
        n = torch.as_tensor(n, dtype=torch.float64)
        return torch.where(n <= last, cost(n), c_last * n / last)

    sizes = torch.arange(PREFILL_CHUNK_MIN, PREFILL_CHUNK_MAX + 1, PREFILL_CHUNK_MIN)
    ok = c(sizes) <= float(c(torch.tensor([float(step_tokens)]))[0]) * (1 + 1e-9)
    return int(sizes[ok].max()) if bool(ok.any()) else PREFILL_CHUNK_MIN


class PrefillPacer:
    """The "auto" prefill chunk, paced by measured chunk forwards.

    The cost curve is measured once, over a short cache, for a single row, but a chunk late in a
    4,000-token prompt attends over everything before it, and the machine's load changes. So the
    pacer predicts a prefill forward of ``N`` tokens over ``span`` cache columns from the last
    chunks it timed::

        seconds = c0 + N * (a + b * span)

    ``c0``: the curve's one-token cost (a forward's fixed cost; at most the cheapest forward
    timed); ``a`` (seconds per token) and ``b`` (per token and attended column: attention) fitted
    by least squares to the per-token cost of the last ``WINDOW`` forwards, newer ones weighted
    more. A chunk may cost ``share`` reference steps (``DecoderConfig.prefill_share``), the
    reference step being a slow average of the running rows' verify forwards. The average keeps a
    batch that shrank for a moment (its streams' next requests waiting behind a chunk) from
    shrinking the chunks too, which would slow the prefill that would let the batch grow again.
    A step that also prefills then takes about ``1 + share`` plain steps.
    A chunk is never more than ``GROWTH`` times the largest one timed (one lucky measurement of
    small chunks must not stall the streams with a huge one). Before the first timed forward the
    chunk is :func:`prefill_chunk` of the curve.

    Where a piece rides in the running rows' verify forward (``DecoderConfig.fuse_prefill``) it
    pays no ``c0``: its own cost ``N (a + b span)`` comes from :meth:`fused_coefficients`, fitted
    over the steps' times (:meth:`observe_verify`), and may cost ``share`` reference steps.
    """

    REF_WEIGHT = 0.05  # weight of the newest verify forward in the reference step's average
    WINDOW = 32  # timed forwards the fit uses
    AGE = 0.9  # weight of a forward one older in the fit
    GROWTH = 2  # a chunk is at most this many times the largest forward timed
    FUSED_WINDOW = 64  # steps the fit of pieces riding in the verify uses
    FUSED_AGE = 0.97  # weight of a step one older in that fit
    MIN_TOKENS = 16  # timed tokens before the fit replaces the curve's cost per token

    def __init__(self, share: float = 1.0):
        self.share = share  # reference steps a piece may cost (DecoderConfig.prefill_share)
        self.obs: collections.deque = collections.deque(maxlen=self.WINDOW)  # (N, span, seconds)
        self.ref: float | None = None  # the reference step (seconds)
        self.largest = 0  # tokens of the largest timed forward
        # (verify's curve cost, piece tokens, piece tokens x span, seconds) of the last steps,
        # where pieces ride in the verify forward (observe_verify)
        self.steps: collections.deque = collections.deque(maxlen=self.FUSED_WINDOW)
        self._fused_fit: tuple | None = None  # (fused_coefficients(),) until a step is added
        self.c0 = 0.0  # the cost curve's one-token forward (seconds)
        self.slope: float | None = None  # the cost curve's cost per token past the first

    def observe_step(self, seconds: float) -> None:
        """The running rows' verify forward took ``seconds``."""
        if seconds and seconds > 0:
            w = self.REF_WEIGHT
            self.ref = seconds if self.ref is None else (1 - w) * self.ref + w * seconds

    def observe(self, tokens: int, span: int, seconds: float, cost: CostCurve) -> None:
        """A prefill forward of ``tokens`` tokens (rows x columns) attending over ``span``
        columns took ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        self.obs.append((tokens, span, seconds))
        if len(cost.sizes) > 1:  # the curve's cost per token past one, for the first fits
            self.slope = float((cost.seconds[-1] - cost.seconds[0]) / (cost.sizes[-1] - 1))
        # the fixed cost: an eager prefill forward's (the curve's one-token forward unless its
        # verifies replay graphs: on a GPU an eager forward of the default target cost far
        # more than its 3.8 ms replay, and that difference read as a per-token cost made the
        # pieces small), but never more than a timed forward
        fixed = cost.seconds[0] if cost.prefill_c0 is None else cost.prefill_c0
        self.c0 = min(float(fixed), min(o[2] for o in self.obs))
        self.largest = max(self.largest, tokens, self._measured(cost))

    def observe_verify(
        self, seconds: float, verify_tokens: int, cost: CostCurve, tokens: int = 0, span: int = 0
    ) -> None:
        """Where pieces ride in the verify forward: a verify of ``verify_tokens`` tokens that
        carried a piece of ``tokens`` tokens over ``span`` columns (0: none) took ``seconds``.
        Kept for :meth:`fused_coefficients`; a step without a piece is also a reference step.
        Before any step without a piece was timed (requests arriving steadily: every step has
        one), the reference step is the curve's cost of the verify."""
        if cost is None or not seconds or seconds <= 0:
            return
        c = float(curve_np(cost, verify_tokens))
        if not tokens:
            self.observe_step(seconds)
        elif self.ref is None:
            self.observe_step(c)
        self.steps.append((c, tokens, tokens * span, seconds))
        self._fused_fit = None
        if tokens:
            self.largest = max(self.largest, tokens, self._measured(cost))

    @staticmethod
    def _measured(cost: CostCurve | None) -> int:
        """The largest forward the cost curve timed (tokens): the growth cap starts there, not
        at the first piece timed (a server's warm-up prompt of one token: the cap then doubled
        piece by piece, 2, 4, 8, ... tokens)."""
        return int(cost.sizes[-1]) if cost is not None else 0

    def fused_coefficients(self) -> tuple[float, float] | None:
        """``(a, b)`` of a piece's own cost, ``N (a + b span)``, fitted with the verify's cost to
        the last ``FUSED_WINDOW`` steps' times: ``seconds = k c(verify tokens) + a N + b N
        span`` by weighted least squares (newer steps more). One step's time says nothing of
        how it splits between the verify and the piece, and the difference from an average
        step is noise as large as a piece (a server's tree sizes change from step to step; it
        read 4-9 ms a token where the fit below reads 0.6-3.4 in long-join runs); across steps of
        different tree and piece sizes the split is identified. ``None`` until 4 steps with a
        piece are timed or where the fit is degenerate. Kept until the next step is observed:
        a fused step asks twice (its limit, then its piece's cost for the guard)."""
        if self._fused_fit is None:
            self._fused_fit = (self._fit_fused(),)
        return self._fused_fit[0]

    def _fit_fused(self) -> tuple[float, float] | None:
        if sum(1 for o in self.steps if o[1]) < 4:
            return None
        X = np.array([o[:3] for o in self.steps], np.float64)
        y = np.array([o[3] for o in self.steps], np.float64)
        w = np.sqrt(
            self.FUSED_AGE ** np.arange(len(y))[::-1]
        )  # (least squares of sqrt-weighted rows)
        for cols in ((0, 1, 2), (0, 1)):  # the attention term dropped when it comes out < 0
            sol, *_ = np.linalg.lstsq(X[:, cols] * w[:, None], y * w, rcond=None)
            if sol[0] > 0 and all(v >= 0 for v in sol[1:]):
                return float(sol[1]), float(sol[2]) if len(cols) == 3 else 0.0
        return None

    def piece_seconds(self, tokens: int, span: int, cost: CostCurve | None) -> float:
        """What a piece of ``tokens`` over ``span`` columns adds to the verify forward it rides
        in (seconds): its fitted own cost, else a forward of its own's past the fixed cost,
        else the cost curve's ``c(tokens) - c(1)``. The speculation guard timed fused steps
        whole: whichever mode ran while pieces rode looked slower (a one-round load test
        prefills most of its prompts that way)."""
        ab = self.fused_coefficients() or (self.coefficients() if self.obs else None)
        if ab is not None:
            return tokens * (ab[0] + ab[1] * span)
        if cost is None:
            return 0.0
        return max(float(curve_np(cost, tokens) - curve_np(cost, 1)), 0.0)

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)`` of the cost model (see the class doc). Until forwards of ``MIN_TOKENS``
        tokens in all are timed: the cost curve's cost per token, ``b = 0`` (a server's first
        piece is its warm-up's one token, whose time past the fixed cost is noise: read as the
        cost per token, it held an engine's first long prompt to pieces of 48 tokens on a
        small CPU)."""
        N, S, secs = (np.array(v, np.float64) for v in zip(*self.obs))
        if N.sum() < self.MIN_TOKENS and self.slope is not None:
            return self.slope, 0.0
        r = np.maximum(secs - self.c0, 0.05 * secs) / N  # seconds per token past the fixed cost
        w = N * self.AGE ** np.arange(len(N))[::-1]  # more tokens, newer: more weight
        flat = float(np.sum(w * r) / np.sum(w))
        Sm = float(np.sum(w * S) / np.sum(w))
        var = float(np.sum(w * (S - Sm) ** 2) / np.sum(w))
        if var < (0.1 * Sm) ** 2 + 1.0:  # spans too alike to tell attention from the rest
            return flat, 0.0
        b = float(np.sum(w * (S - Sm) * (r - flat)) / np.sum(w) / var)
        a = flat - b * Sm
        if b < 0:
            return flat, 0.0
        if a < 0:
            return 0.0, float(np.sum(w * r * S) / np.sum(w * S * S))
        return a, b

    def fits(
        self, steps: float = 1.0, fused: bool = False, capped: bool = True
    ) -> Callable[[int, int], bool] | None:
        """``fits(tokens, span)``: whether such a forward costs no more than ``share x steps``
        reference steps (``steps``: how many the caller allows, e.g. the running rows' step
        scaled to every admitted request); ``None`` before a forward and a step are timed (use
        the curve). ``fused``: the piece rides in the verify forward (no fixed cost of its
        own): its tokens' cost alone is held to the share. ``capped``: at most ``GROWTH``
        times the largest forward timed (off while no row decodes: nobody to stall)."""
        ab = self.fused_coefficients() if fused else None
        if self.ref is None or (ab is None and not self.obs):
            return None
        # riding pieces: their own cost, fitted (until it holds: a forward of its own's cost
        # past the fixed one), held to the share, no fixed cost first
        a, b = ab or self.coefficients()
        cap = self.GROWTH * max(self.largest, 1) if capped else PREFILL_CHUNK_MAX
        if fused:
            budget = self.share * steps * self.ref
            return lambda tokens, span: tokens <= cap and tokens * (a + b * span) <= budget
        # a forward's fixed cost is paid whatever its size: when it alone exceeds the share (an
        # eager prefill of 34 ms against 3.5 ms graph replays on a GPU), pieces that fit
        # "nothing" became one token each and a 300-token prompt took 2.5 s; then a piece may
        # add as much work as the fixed cost (at least half its time does prefill)
        budget = max(self.share * steps * self.ref - self.c0, self.c0)
        return lambda tokens, span: tokens <= cap and tokens * (a + b * span) <= budget
