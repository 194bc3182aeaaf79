"""How big a tree to verify, and which drafters are worth calling.

Verifying n tokens in one forward costs ``c(n)``; on a CPU in float32 c(64) is several times
c(1), in bfloat16 with AMX or on a GPU it is nearly flat up to tens of tokens. Each candidate
node has an estimated probability ``v`` of being accepted (the product, along its path, of the
observed acceptance rate of its drafter, path group and depth: :class:`AcceptanceStats`). With
nodes sorted by value, verifying the top K yields ``1 + sum(v_1..v_K)`` tokens per row and call,
so the decoder picks the K that maximises ``(1 + sum v) / c(K + 1)``: the most expected tokens
per unit of verify time (:func:`best_budget`).

A batch of B rows verifies a ``[B, K + 1]`` tree: its cost is modelled as ``c(B * (K + 1))``
(one row's curve at the batch's token count, extrapolated linearly past the measured sizes),
and one K is chosen for the whole batch. At batch 1 the rule is the one above; as the batch
grows the forward stops being flat and K shrinks, so speculation does not slow a loaded server.

:class:`DrafterGate` decides which drafters to call at all: pruning drops a weak drafter's
nodes, but its drafting time is paid before pruning.

Everything that runs every step stays on the decoder's device (no host reads): the rates, the
node values and the chosen K.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np
import torch

SIZES = (1, 2, 4, 8, 16, 32, 64)


class CostCurve:
    """Piecewise-linear verify cost ``c(n)`` (seconds) from measured points; linear past the last
    point with the slope of the last segment (flat when only one point is known).

    ``raw``: what each size cost as measured, when that differs from ``seconds`` (a measured
    curve's ``seconds`` are its monotone envelope, :func:`measure_cost_curve`).
    ``prefill_c0``: the fixed cost of an eager prefill forward (seconds), where verifies replay
    CUDA graphs and prefills do not, so ``seconds[0]`` is not it (``None``: the same).
    """

    def __init__(self, sizes, seconds, raw=None, prefill_c0: float | None = None):
        self.sizes = torch.tensor(list(sizes), dtype=torch.float64)
        self.seconds = torch.tensor(list(seconds), dtype=torch.float64)
        self.raw = self.seconds if raw is None else torch.tensor(list(raw), dtype=torch.float64)
        self.prefill_c0 = prefill_c0
        self._tables: dict = {}

    def __call__(self, n: torch.Tensor) -> torch.Tensor:
        """Interpolated cost of forwards with ``n`` tokens (any shape)."""
        n = torch.as_tensor(n).to(torch.float64).cpu()
        x, y = self.sizes, self.seconds
        if len(x) == 1:
            return torch.full_like(n, float(y[0]))
        i = torch.searchsorted(x, n.clamp(x[0], x[-1])).clamp(1, len(x) - 1)
        x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
        out = y0 + (n.clamp(min=x[0]) - x0) * (y1 - y0) / (x1 - x0)
        return out.clamp(min=float(y[0]))

    def table(self, n_max: int, device) -> torch.Tensor:
        """``[n_max + 1]`` float32 on ``device``: ``c(0..n_max)`` (cached; c(0) = c(1))."""
        key = (n_max, str(device))
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = self(torch.arange(n_max + 1).clamp(min=1)).float().to(device)
        return t

    def to_dict(self) -> dict:
        out = {
            "sizes": self.sizes.long().tolist(),
            "ms": [round(s * 1e3, 3) for s in self.seconds.tolist()],
        }
        if not torch.equal(self.raw, self.seconds):
            out["raw_ms"] = [round(s * 1e3, 3) for s in self.raw.tolist()]
        if self.prefill_c0 is not None:
            out["prefill_ms"] = round(self.prefill_c0 * 1e3, 3)
        return out

    @classmethod
    def from_ms(cls, spec) -> CostCurve:
        """From ``{"sizes": [...], "ms": [...]}`` (``"raw_ms"`` optional), ``"tokens:ms,..."``,
        or the path of a JSON file holding such a dict, or a ``redraft-bench --out`` file (its
        ``cost_curve_ms``)."""
        if isinstance(spec, str) and spec.endswith(".json"):
            import json
            from pathlib import Path

            spec = json.loads(Path(spec).read_text())
            spec = spec.get("cost_curve_ms", spec)
        if isinstance(spec, dict):
            raw, pre = spec.get("raw_ms"), spec.get("prefill_ms")
            return cls(
                spec["sizes"],
                [m / 1e3 for m in spec["ms"]],
                None if raw is None else [m / 1e3 for m in raw],
                None if pre is None else pre / 1e3,
            )
        pts = [tuple(float(x) for x in kv.split(":")) for kv in str(spec).split(",")]
        return cls([int(n) for n, _ in pts], [ms / 1e3 for _, ms in pts])

    @classmethod
    def flat(cls) -> CostCurve:
        """A cost that does not depend on n (use the whole draft)."""
        return cls([1, 1024], [1.0, 1.0])


@torch.no_grad()
def measure_cost_curve(
    forward, sizes=SIZES, repeats: int = 3, sync=None, padded: bool = True
) -> CostCurve:
    """Time ``forward(n)`` (one verify forward of n tokens) for each n; the fastest of ``repeats``
    (other processes only ever add time, so the minimum is the device's own cost).

    The curve's ``seconds`` are the monotone envelope from the right, ``c(n) = min over m >= n
    of the time measured at m``, and ``raw`` what each size cost. A forward of n tokens can
    always be padded to m >= n tokens (the padding filled with more draft candidates, which
    only helps: :meth:`~redraft.infer.verify.Verifier.tree_size`), so a size dearer than a
    larger one (a noisy measurement, or a kernel that is slow at that shape) never prices the
    sizes around it. (The envelope from the left, ``max over m <= n``, did: on a GPU a
    2-token forward measured at 2x a one-token one priced every tree up to 65 tokens at
    that, while trees of ~32 nodes verified in 5.2 ms against greedy's 4.1 ms.) With
    ``padded=False`` (work that cannot be padded, like a beam search) the envelope is taken
    from the left, ``max over m <= n``.

    ``forward`` runs the target on n tokens over a cache of realistic length and returns nothing;
    ``sync`` (e.g. ``torch.cuda.synchronize``) is called before reading the clock.
    """
    sync = sync or (lambda: None)
    secs = []
    forward(sizes[0])  # warm-up (allocator, kernels)
    sync()
    for n in sizes:
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            forward(n)
            sync()
            ts.append(time.perf_counter() - t0)
        secs.append(min(ts))
    t = torch.tensor(secs, dtype=torch.float64)
    if not padded:  # work that cannot be padded to a cheaper size (a beam search): max over m <= n
        return CostCurve(sizes, t.cummax(dim=0).values.tolist(), raw=secs)
    env = t.flip(0).cummin(dim=0).values.flip(0).tolist()
    return CostCurve(sizes, env, raw=secs)


def best_budget(
    values: torch.Tensor, cost: CostCurve, max_nodes: int, overhead_s: float = 0.0
) -> torch.Tensor:
    """Nodes to verify per row, one K for the whole batch (see the module doc).

    Args:
        values: ``[B, M]`` estimated acceptance probability of every candidate node (0 for
            padding).
        cost: the verify cost curve of one row.
        max_nodes: upper bound on K.
        overhead_s: fixed per-step time outside the forward (drafting, acceptance).

    Returns:
        ``[B]`` long on ``values.device``, every entry the K maximising
        ``(B + sum over rows of the K largest values) / (c(B * (K + 1)) + overhead)``.
    """
    B, M = values.shape
    M = min(M, max_nodes)
    if M == 0 or B == 0:
        return torch.zeros(B, dtype=torch.long, device=values.device)
    top = values.float().clamp(0, 1).topk(M, dim=1).values  # [B, M] descending
    gain = B + torch.cat([top.new_zeros(1), top.sum(dim=0).cumsum(dim=0)])  # [M+1]: K = 0..M
    secs = cost.table(B * (M + 1), values.device)[B * torch.arange(1, M + 2, device=values.device)]
    k = (gain / (secs + overhead_s)).argmax()
    return k.expand(B)


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


class BatchCost:
    """Verify cost of a batch, ``c(B rows, n tokens each)``, from forwards measured at a few
    batch sizes (``by_batch``: B -> a :class:`CostCurve` over tokens per row; B = 1 is the
    one-row curve). A batch of B rows does not cost what one row of ``B * n`` tokens costs (each
    row attends over its own cache; on CPUs the matrix kernels change with the row count), so
    the budget and the speculation guard's first verdicts read batches off this instead of the
    one-row curve's ``c(B * n)``. Between measured batch sizes the cost is interpolated linearly
    in B; past the largest it grows in proportion to B (a bound: the forward only gets less flat).
    """

    def __init__(self, by_batch: dict[int, CostCurve]):
        self.batches = sorted(by_batch)
        self.curves = by_batch

    def __call__(self, B: int, n) -> np.ndarray:
        """Seconds of a forward of ``B`` rows x ``n`` tokens per row (``n``: int or array)."""
        bs = self.batches
        if B >= bs[-1]:
            return curve_np(self.curves[bs[-1]], n) * (B / bs[-1])
        if B <= bs[0]:
            return curve_np(self.curves[bs[0]], n)
        hi = next(b for b in bs if b >= B)
        lo = max(b for b in bs if b <= B)
        c_lo = curve_np(self.curves[lo], n)
        if hi == lo:
            return c_lo
        return c_lo + (B - lo) / (hi - lo) * (curve_np(self.curves[hi], n) - c_lo)

    def to_dict(self) -> dict:
        return {str(b): c.to_dict() for b, c in self.curves.items()}


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


class AcceptanceStats:
    """Running acceptance rate per (drafter, path group, depth), with a Beta prior, on a device.

    ``rate[d, g, l]`` estimates P(the entry at depth l of a drafter-d path of group g is
    accepted | its parent was). A path's group is what its drafter says it is
    (``Draft.group``, e.g. the length of the context match behind it), else its rank. Counts
    decay (``decay`` per update of a drafter) so the estimate follows the request.

    The Beta prior (``prior_weight`` pseudo-tries) has the mean ``prior_rate`` at depth 0 and,
    below it, the estimated rate of the depth above: a depth never verified is expected to be
    accepted as often as its parent's depth, not at a flat ``prior_rate``. With a flat prior the
    budget, which verifies a node only when its expected value pays for its cost, never tries a
    depth whose prior says it loses, so that depth's rate is never learnt: drafts that are
    right for 20 tokens (a repeated answer) were cut at the depth the prior first made too
    expensive.
    """

    def __init__(
        self,
        num_drafters: int,
        max_groups: int = 32,
        max_depth: int = 16,
        prior_rate: float = 0.3,
        prior_weight: float = 2.0,
        decay: float = 0.98,
        device=None,
    ):
        shape = (max(num_drafters, 1), max_groups, max_depth)
        self.max_groups, self.max_depth, self.decay = max_groups, max_depth, decay
        self.prior = (prior_rate * prior_weight, prior_weight)
        self.hits = torch.zeros(shape, dtype=torch.float32, device=device)
        self.tries = torch.zeros(shape, dtype=torch.float32, device=device)

    def reset(self) -> None:
        self.hits.zero_()
        self.tries.zero_()

    def rates(self) -> torch.Tensor:
        """``[drafters, groups, depths]`` estimated acceptance rates."""
        p0, p1 = self.prior
        r = torch.empty_like(self.hits)
        r[..., 0] = (self.hits[..., 0] + p0) / (self.tries[..., 0] + p1)
        for lv in range(1, r.shape[-1]):  # the prior of depth l: the rate of depth l - 1
            r[..., lv] = (self.hits[..., lv] + p1 * r[..., lv - 1]) / (self.tries[..., lv] + p1)
        return r

    def _groups(self, B: int, P: int, group: torch.Tensor | None) -> torch.Tensor:
        dev = self.hits.device
        g = (
            torch.arange(P, device=dev)[None].expand(B, P)
            if group is None
            else group.to(dev).long()
        )
        return g.clamp(0, self.max_groups - 1)

    def values(
        self, drafter, shape: tuple[int, int, int], group: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[B, P, L]`` path-product of rates for paths of ``shape``: ``drafter`` is an int, or a
        ``[P]`` long tensor (the drafter of every path), ``group [B, P]`` (default: the rank)."""
        B, P, L = shape
        dev = self.hits.device
        d = torch.as_tensor(drafter, device=dev).expand(P)[None].expand(B, P)  # [B, P]
        depths = torch.arange(L, device=dev).clamp(max=self.max_depth - 1)
        per = self.rates()[d[:, :, None], self._groups(B, P, group)[:, :, None], depths[None, None]]
        return per.cumprod(dim=2)

    def update(
        self,
        drafter,
        tokens: torch.Tensor,
        accepted_prefix: torch.Tensor,
        group: torch.Tensor | None = None,
        kept: torch.Tensor | None = None,
    ) -> None:
        """Record one step.

        Args:
            drafter: int, or ``[P]`` long: the drafter of every path (one call for the mix).
            tokens: ``[B, P, L]`` the paths (entries < 0 do not exist).
            accepted_prefix: ``[B, P]`` tokens of each path that were accepted.
            group: ``[B, P]`` groups (default: rank).
            kept: ``[B, P, L]`` bool, entries that were verified (default: every valid entry).
        """
        B, P, L = tokens.shape
        if P == 0:
            return
        dev = self.hits.device
        L_ = min(L, self.max_depth)
        depth = torch.arange(L_, device=dev)
        valid = (tokens[:, :, :L_] >= 0).to(dev) if kept is None else kept[:, :, :L_].to(dev)
        pre = accepted_prefix.to(dev)[:, :, None]
        tried = valid & (depth <= pre)  # the parent was accepted
        hit = tried & (depth < pre)
        d = torch.as_tensor(drafter, device=dev).expand(P)
        flat = ((d * self.max_groups + self._groups(B, P, group)) * self.max_depth)[
            :, :, None
        ] + depth  # [B, P, L_]
        decay = torch.ones(self.hits.shape[0], device=dev).index_fill_(0, d, self.decay)[
            :, None, None
        ]
        self.hits.mul_(decay).view(-1).index_add_(0, flat.reshape(-1), hit.reshape(-1).float())
        self.tries.mul_(decay).view(-1).index_add_(0, flat.reshape(-1), tried.reshape(-1).float())


class DrafterGate:
    """Which drafters to call: skip one while the tokens only it gets accepted are worth less
    time than its drafting costs.

    The gate keeps exponential moving averages of each drafter's drafting seconds, of the
    accepted tokens per step that no other drafter proposed ("exclusive gain"), and of the
    seconds one output token costs. A drafter is worth calling when
    ``gain * seconds_per_token >= drafting seconds``; one that is not waits ``explore`` steps
    before it is tried again, and every try that finds it still not worth it doubles the wait
    (up to ``MAX_WAIT_FACTOR * explore``), so a useless drafter ends up costing almost nothing.
    Unknown gains count as worth it, and so does a drafter whose drafting costs at most
    ``FREE_SHARE`` of an output token's time: skipping it could save no more than that, while
    skipping it wrongly loses its tokens (two drafters that propose many of the same tokens each
    show little exclusive gain, and the one left alone then looks like the only one that
    works). Gating never changes the output, only the speed.
    """

    TIME_EMA = 0.8  # weight of the past in the drafting-time and seconds-per-token averages
    GAIN_EMA = 0.7  # weight of the past in the exclusive-gain average
    MAX_WAIT_FACTOR = 16
    FREE_SHARE = 0.01  # drafting under 1% of a token's time is always worth calling

    def __init__(self, num_drafters: int, explore: int = 8, enabled: bool = True):
        self.n, self.explore, self.enabled = num_drafters, max(int(explore), 1), enabled
        self.secs = [0.0] * num_drafters  # drafting seconds per call
        self.gain: list[float | None] = [None] * num_drafters  # exclusive accepted tokens per step
        self.idle = [0] * num_drafters  # steps since the last call
        self.wait = [self.explore] * num_drafters  # steps a skipped drafter waits before a re-run
        self.sec_per_token: float | None = None

    def net(self, i: int) -> float:
        """Seconds drafter i saves per step (inf while its gain is unknown)."""
        g = self.gain[i]
        return float("inf") if g is None else g * (self.sec_per_token or 0.0) - self.secs[i]

    def active(self) -> list[int]:
        """Indices of the drafters to call this step (every drafter while gating is off or
        nothing is known yet); advances the idle counters."""
        if not self.enabled or self.sec_per_token is None:
            return list(range(self.n))
        net = [self.net(i) for i in range(self.n)]
        free = self.FREE_SHARE * self.sec_per_token
        active = []
        for i in range(self.n):
            if net[i] >= 0 or self.secs[i] <= free:
                self.wait[i] = self.explore
                active.append(i)
            elif self.idle[i] + 1 >= self.wait[i]:  # re-run; back off if still not worth it
                self.wait[i] = min(2 * self.wait[i], self.MAX_WAIT_FACTOR * self.explore)
                active.append(i)
        if not active:
            active = [max(range(self.n), key=lambda i: net[i])]
        for i in range(self.n):
            self.idle[i] = 0 if i in active else self.idle[i] + 1
        return active

    def record_time(self, i: int, secs: float) -> None:
        """Drafter i took ``secs`` to draft this step."""
        a = self.TIME_EMA
        self.secs[i] = a * self.secs[i] + (1 - a) * secs if self.secs[i] else secs

    def update(self, step_secs: float, tokens_per_row: float, exclusive: dict[int, float]) -> None:
        """After a step: its wall time, the tokens a row gained on average (accepted + 1), and
        for each drafter called, its exclusive accepted tokens per row."""
        spt = step_secs / max(tokens_per_row, 1e-9)
        a = self.TIME_EMA
        self.sec_per_token = (
            spt if self.sec_per_token is None else a * self.sec_per_token + (1 - a) * spt
        )
        if not self.enabled:
            return
        for i, g in exclusive.items():
            old = self.gain[i]
            self.gain[i] = g if old is None else self.GAIN_EMA * old + (1 - self.GAIN_EMA) * g


class SpeculationGuard:
    """Speculate only at batch sizes where it is measured to pay.

    The budget's cost model uses the verify cost of one row (``c(B * (K + 1))``), but a batch
    of B rows does not cost what one row of as many tokens costs (each row attends over its own
    cache; on CPUs the matrix kernels change with the row count), and the node values overrate
    trees whose drafters propose alternatives. So the guard measures instead: per batch-size
    bucket (1, 2-3, 4-7, 8-15, ...) it alternates runs of speculative and plain steps (plain:
    no drafter called, one token per row) and keeps, for each, the output tokens per second of
    its latest run (the first step of a run is not counted: it pays for warm-ups such as the
    cost-curve measurement or a CUDA graph capture). After the first comparison the faster mode
    runs; speculation that lost is re-tried after ``explore`` steps, the wait doubling (up to
    ``MAX_WAIT_FACTOR * explore``) while it keeps losing; speculation that won is re-checked
    against a short plain run every ``REPROBE`` steps. Batches below ``min_batch`` always
    speculate (one row's cost is what the cost curve measures). Plain steps are exact: the guard
    changes the speed, never the output.

    A bucket that no neighbour informs starts from the cost model's verdict (``prior``: the
    decoder's measured batched verify costs and its recent node values): predicted to lose, it
    starts with a plain stretch of ``PRIOR_WAIT * explore`` steps (a short request does not pay
    for the check), then one speculative run checks the prediction.

    A bucket seen for the first time starts from its neighbours' verdicts instead of exploring
    blind (a server's batch size moves between buckets all the time in its first seconds): the
    verify forward only gets less flat as the batch grows, so speculation that lost at a smaller
    batch starts a larger one with a plain stretch (then one speculative run re-checks it), and
    speculation that won at a larger batch starts a smaller one with a long speculative stretch.
    """

    RUN = 4  # steps of one mode per measurement (the first one not counted)
    MAX_WAIT_FACTOR = 16
    FREE_SHARE = 0.01  # drafting under 1% of a token's time is always worth calling
    REPROBE = 128  # steps of winning speculation between plain re-measurements
    PRIOR_WAIT = 4  # a bucket predicted to lose: plain steps (x explore) before the first check

    def __init__(self, explore: int = 8, min_batch: int = 2, enabled: bool = True):
        self.explore, self.min_batch, self.enabled = max(int(explore), 1), min_batch, enabled
        self._buckets: dict[int, _GuardBucket] = {}
        # batch size -> the cost model's verdict (True/False) or None: a bucket that no
        # neighbour informs starts from it (the decoder's measured batched costs)
        self.prior = None

    @staticmethod
    def bucket(batch: int) -> int:
        return int(batch).bit_length()

    def _state(self, batch: int) -> _GuardBucket:
        b = self.bucket(batch)
        if b not in self._buckets:
            st = self._buckets[b] = _GuardBucket(left=self.RUN, wait=self.explore)
            if any(k < b and o.verdict is False for k, o in self._buckets.items()):
                st.speculative, st.held, st.left = False, True, self.explore
            elif any(k > b and o.verdict is True for k, o in self._buckets.items()):
                st.left = self.REPROBE
            elif self.prior is not None and self.prior(batch) is False:
                # trusted for a while: a short request should not pay the check's losing steps
                st.speculative, st.held, st.left = False, True, self.PRIOR_WAIT * self.explore
        return self._buckets[b]

    def speculate(self, batch: int) -> bool:
        """Whether the next step at this batch size drafts."""
        if not self.enabled or batch < self.min_batch:
            return True
        st = self._state(batch)
        if st.left <= 0:
            self._next_run(st)
        st.left -= 1
        return st.speculative

    def _next_run(self, st: _GuardBucket) -> None:
        """A run ended: keep its figure, then choose the next run's mode and length."""
        if st.steps > 1 and st.secs > 0:
            st.tps[st.speculative] = st.tokens / st.secs
        st.steps, st.secs, st.tokens = 0, 0.0, 0
        last, held, st.held = st.speculative, st.held, False
        spec, plain = st.tps.get(True), st.tps.get(False)
        if spec is None or plain is None:  # measure the mode that has no figure yet
            st.speculative, st.left = spec is None, self.RUN
        elif spec >= plain:
            st.wait = self.explore
            # after a plain run: speculate for a long stretch; after that stretch: a short plain probe
            st.speculative, st.left = (True, self.REPROBE) if not last else (False, self.RUN)
        elif (
            last or not held
        ):  # speculation lost (tried just now, or against a plain run): plain for a while
            st.speculative, st.left, st.held = False, st.wait, True
            st.wait = min(2 * st.wait, self.MAX_WAIT_FACTOR * self.explore)
        else:  # the plain stretch is over: try speculation again
            st.speculative, st.left = True, self.RUN

    def record(self, batch: int, speculative: bool, tokens: int, seconds: float) -> None:
        """A step at this batch size emitted ``tokens`` (all rows) in ``seconds``."""
        if not self.enabled or batch < self.min_batch or seconds <= 0:
            return
        st = self._state(batch)
        if speculative != st.speculative:
            return
        st.steps += 1
        if st.steps > 1:  # the first step of a run pays the warm-ups
            st.secs += seconds
            st.tokens += tokens


@dataclasses.dataclass
class _GuardBucket:
    """One batch-size bucket of :class:`SpeculationGuard`: the current run and the figures."""

    left: int  # steps left in the current run
    wait: int  # plain steps before losing speculation is tried again
    speculative: bool = True  # the current run's mode
    held: bool = False  # the current run is a plain stretch after speculation lost
    steps: int = (
        0  # the current run's steps so far, and the seconds and tokens of all but its first
    )
    secs: float = 0.0
    tokens: int = 0
    tps: dict = dataclasses.field(default_factory=dict)  # mode -> output tokens/s of its latest run

    @property
    def verdict(self) -> bool | None:
        """Whether speculation won the latest comparison (None: not compared yet)."""
        spec, plain = self.tps.get(True), self.tps.get(False)
        return None if spec is None or plain is None else spec >= plain
