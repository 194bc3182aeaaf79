"""How long the chains the proposer sends should be, from what vLLM's steps are measured to cost.

A draft token that is accepted saves a step; every draft token, accepted or not, makes the verify
forward longer. On a GPU at a small batch the forward is nearly flat in its token count and any
likely draft pays; on a CPU, or at a large batch anywhere, each verified token costs real time
and only drafts that are likely to be accepted pay. Which regime vLLM is in depends on the
device, the model, the batch and the load, so the proposer measures it instead of assuming it.

:class:`StepCost` records, between two consecutive ``propose`` calls, the wall-clock time of
vLLM's step and the tokens it verified (one per row plus the chain sent for it); a step is
recorded only when its rows are exactly the last step's rows, each continuing its request (a
joining request's prefill would otherwise count as verify time). The cost of a step with ``N``
tokens is the median of the last few steps of that size, made non-decreasing in ``N``; between
measured sizes it is interpolated, below the smallest it is taken proportional to ``N`` and above
the largest equal to the largest's. Both guesses are optimistic, so the proposer tries a size it
has not measured, measures it, and moves back if it was dearer than hoped.

:func:`chain_lengths` then sends the draft tokens, most likely first across all rows, that
maximise the expected tokens per second of the step: ``(rows + sum of their acceptance
estimates) / cost(rows + tokens sent)``, the rule redraft's own decoder uses for its trees
(``redraft.infer.runner.cost``).

Timings differ between tensor-parallel ranks, so ranks may choose different lengths; vLLM takes
the drafts of one rank (its ``output_rank``) and sends them to all, so the verify stays the same
everywhere, and the learned acceptance rates, which do not depend on timing, stay equal.
"""

from __future__ import annotations

from collections import deque

import numpy as np

KEEP = 8  # steps of each size whose median is that size's cost


class StepCost:
    """Measured cost of vLLM's step by the number of tokens it verifies (see the module doc)."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self.times: dict[int, deque] = {}
        self._curve: tuple[np.ndarray, np.ndarray] | None = None

    def record(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0:
            return
        self.times.setdefault(int(tokens), deque(maxlen=self.keep)).append(float(seconds))
        self._curve = None

    def curve(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(sizes, seconds)`` measured, ascending and non-decreasing; ``None`` before any."""
        if self._curve is None and self.times:
            sizes = np.array(sorted(self.times), dtype=np.float64)
            med = np.array([np.median(self.times[int(n)]) for n in sizes])
            count = np.array([len(self.times[int(n)]) for n in sizes], dtype=np.float64)
            self._curve = (sizes, _isotonic(med, count))
        return self._curve

    def __call__(self, tokens: np.ndarray) -> np.ndarray | None:
        """Estimated seconds of steps verifying ``tokens`` (array); ``None`` before any step."""
        c = self.curve()
        if c is None:
            return None
        sizes, sec = c
        n = np.asarray(tokens, dtype=np.float64)
        out = np.interp(n, sizes, sec)  # flat above the largest measured size
        below = n < sizes[0]
        return np.where(below, sec[0] * n / sizes[0], out)

    def to_dict(self) -> dict:
        c = self.curve()
        if c is None:
            return {}
        return {"tokens": c[0].astype(int).tolist(), "ms": np.round(c[1] * 1e3, 3).tolist()}


def _isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence nearest ``y`` in weighted least squares (pool adjacent
    violators): a bigger step is never cheaper, whatever the noise of single sizes."""
    vals, wts, lens = [], [], []
    for v, c in zip(y.tolist(), w.tolist()):
        vals.append(v)
        wts.append(c)
        lens.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            v2, c2, n2 = vals.pop(), wts.pop(), lens.pop()
            c1 = wts[-1]
            vals[-1] = (vals[-1] * c1 + v2 * c2) / (c1 + c2)
            wts[-1] = c1 + c2
            lens[-1] += n2
    return np.repeat(vals, lens)


def chain_lengths(values: np.ndarray, cost: StepCost) -> np.ndarray:
    """Per row, how many leading tokens of its chain to send.

    ``values`` ``[B, k]``: each chain token's estimated probability of being accepted (0 for
    tokens not to send; non-increasing along a chain). The tokens are taken most likely first
    (a chain's earlier token first on ties, so each row sends a prefix) while that raises
    ``(B + sum of values) / cost(B + tokens)``; before any step is measured every token is sent.
    """
    B, k = values.shape
    lengths = (values > 0).sum(1)
    if not lengths.any():
        return lengths
    flat = values.reshape(-1)
    depth = np.tile(np.arange(k), B)
    order = np.lexsort((depth, -flat))[: int(lengths.sum())]
    tokens = B + np.arange(len(order) + 1)
    c = cost(tokens)
    if c is None:
        return lengths
    gain = B + np.concatenate([[0.0], np.cumsum(flat[order])])
    best = int(np.argmax(gain / c))  # the first of equal rates: fewer tokens
    out = np.zeros(B, dtype=np.int64)
    np.add.at(out, order[:best] // k, 1)
    return out
