"""What a verify forward costs: the curve ``c(n)`` of one row verifying ``n`` tokens, and
:class:`BatchCost` for batches, measured on the decoder's device.

Verifying n tokens in one forward costs ``c(n)``; on a CPU in float32 c(64) is several times
c(1), in bfloat16 with AMX or on a GPU it is nearly flat up to tens of tokens. Each candidate
node has an estimated probability ``v`` of being accepted (the product, along its path, of the
observed acceptance rate of its drafter, path group and depth:
``redraft.infer.spec.hostdraft.HostStats``). With nodes sorted by value, verifying the top K
yields ``1 + sum(v_1..v_K)`` tokens per row and call, so the decoder picks the K that maximises
``(1 + sum v) / c(K + 1)``: the most expected tokens per unit of verify time
(``redraft.infer.spec.hostdraft.best_budget_np``).

A batch of B rows verifies a ``[B, K + 1]`` tree: its cost is modelled as ``c(B * (K + 1))``
(one row's curve at the batch's token count, extrapolated linearly past the measured sizes), or
read off :class:`BatchCost` where batched forwards were measured, and one K is chosen for the
whole batch. At batch 1 the rule is the one above; as the batch grows the forward stops being
flat and K shrinks, so speculation does not slow a loaded server.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from redraft.infer.runner.step_input import chain_step

# tree sizes (root included) the curve is measured at. 6 and 12 too: a CPU's packed kernels
# change blocking between 4 and 8 rows (6 tokens can cost what 4 do, 8 a fifth more), and a
# curve interpolated from 4 to 8 overpriced the 5-6 node trees the budget most often weighs
SIZES = (1, 2, 4, 6, 8, 12, 16, 32, 64)


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
    only helps: :meth:`~redraft.infer.runner.verify.Verifier.tree_size`), so a size dearer than a
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


def measure_batch_cost(verifier, curve: CostCurve, batches, sizes, context: int = 256) -> BatchCost:
    """Time a :class:`~redraft.infer.runner.verify.Verifier`'s forwards of ``B`` rows (each over
    a ``context``-token cache) x ``n`` tokens per row for each B in ``batches`` and n in
    ``sizes``; ``curve`` (the one-row curve) is B = 1. The fastest of two runs each (other
    processes only add time)."""
    by_batch = {1: curve}
    for B in sorted(set(batches) - {1}):
        cache = verifier.new_cache(B, context + max(sizes) + 1)
        verifier.prefill([[0] * context] * B, cache)
        cache.batch, cache.host_lengths = B, [context] * B

        def fwd(n, B=B, cache=cache):
            verifier.logits(verifier.verify(chain_step([context] * B, n, verifier.device), cache))

        by_batch[B] = measure_cost_curve(fwd, sizes, repeats=2, sync=verifier.sync)
    return BatchCost(by_batch)
