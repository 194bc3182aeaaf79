"""Acceptance rates and the node budget on the host: numpy mirrors of the tests' torch oracles.

Every path entry's value is the product of its drafter's acceptance rates along the path
(:class:`HostStats`, learnt from the steps' accepted prefixes); the budget rule then picks the
one K (nodes per row) for the batch that maximises expected tokens per second
(:func:`best_budget_np`). Each returns exactly what its torch counterpart returns (the tests
compare them on random inputs):

=========================  ==================================================================
here                       torch original
=========================  ==================================================================
:class:`HostStats`          ``reference.budget.AcceptanceStats`` (tests)
:func:`best_budget_np`      ``reference.budget.best_budget`` (tests; one K for the batch, a host int)
=========================  ==================================================================

The compiled versions are :mod:`redraft.infer.spec.hostjit.stats`.
"""

from __future__ import annotations

import numpy as np

from redraft.infer.spec import hostjit


class HostStats:
    """``reference.budget.AcceptanceStats`` (tests) in host float32 arrays: the same rates after the same updates.

    ``rate[d, g, l]`` estimates P(the entry at depth l of a drafter-d path of group g is
    accepted | its parent was), with a Beta prior and a decay per update of a drafter; the
    prior's mean is ``prior_rate`` at depth 0 and the rate of depth ``l - 1`` below it.
    """

    def __init__(
        self,
        num_drafters: int,
        max_groups: int = 32,
        max_depth: int = 16,
        prior_rate: float = 0.3,
        prior_weight: float = 2.0,
        decay: float = 0.98,
    ):
        shape = (max(num_drafters, 1), max_groups, max_depth)
        self.max_groups, self.max_depth, self.decay = max_groups, max_depth, np.float32(decay)
        self.prior = (prior_rate * prior_weight, prior_weight)
        self.hits = np.zeros(shape, dtype=np.float32)
        self.tries = np.zeros(shape, dtype=np.float32)

    def reset(self) -> None:
        self.hits.fill(0)
        self.tries.fill(0)

    def rates(self) -> np.ndarray:
        """``[drafters, groups, depths]`` float32 estimated acceptance rates."""
        p0, p1 = np.float32(self.prior[0]), np.float32(self.prior[1])
        r = np.empty_like(self.hits)
        r[..., 0] = (self.hits[..., 0] + p0) / (self.tries[..., 0] + p1)
        for lv in range(1, r.shape[-1]):  # the prior of depth l: the rate of depth l - 1
            r[..., lv] = (self.hits[..., lv] + p1 * r[..., lv - 1]) / (self.tries[..., lv] + p1)
        return r

    def _groups(self, B: int, P: int, group) -> np.ndarray:
        g = (
            np.broadcast_to(np.arange(P), (B, P))
            if group is None
            else np.asarray(group, dtype=np.int64)
        )
        return np.clip(g, 0, self.max_groups - 1)

    def values(self, owner, shape: tuple[int, int, int], group=None) -> np.ndarray:
        """``[B, P, L]`` float32 path-product of rates: ``owner`` an int or ``[P]`` (the drafter
        of every path), ``group [B, P]`` (default: the rank)."""
        B, P, L = shape
        if hostjit.ENABLED:
            return hostjit._stats_values(
                self.hits,
                self.tries,
                np.float32(self.prior[0]),
                np.float32(self.prior[1]),
                hostjit.owners(owner, P),
                _NO_GROUP if group is None else np.asarray(group, np.int64),
                group is not None,
                B,
                P,
                L,
            )
        d = np.broadcast_to(np.asarray(owner, dtype=np.int64), (P,))[None]  # [1, P]
        depths = np.minimum(np.arange(L), self.max_depth - 1)
        per = self.rates()[d[:, :, None], self._groups(B, P, group)[:, :, None], depths[None, None]]
        # torch's CPU cumprod accumulates float32 in double and rounds each output: the same here
        return np.cumprod(per, axis=2, dtype=np.float64).astype(np.float32)

    def update(self, owner, paths, accepted_prefix, group=None, kept=None) -> None:
        """Record one step (``AcceptanceStats.update``): ``paths [B, P, L]``, ``accepted_prefix
        [B, P]``, ``group [B, P]`` (default: rank), ``kept [B, P, L]`` bool (default: valid)."""
        paths = np.asarray(paths)
        B, P, L = paths.shape
        if P == 0:
            return
        if hostjit.ENABLED:
            hostjit._stats_update(
                self.hits,
                self.tries,
                self.decay,
                hostjit.owners(owner, P),
                _NO_GROUP if group is None else np.asarray(group, np.int64),
                group is not None,
                (paths >= 0) if kept is None else np.asarray(kept, bool),
                np.asarray(accepted_prefix, np.int64),
            )
            return
        L_ = min(L, self.max_depth)
        depth = np.arange(L_)
        valid = (paths[:, :, :L_] >= 0) if kept is None else np.asarray(kept)[:, :, :L_]
        pre = np.asarray(accepted_prefix)[:, :, None]
        tried = valid & (depth <= pre)  # the parent was accepted
        hit = tried & (depth < pre)
        d = np.broadcast_to(np.asarray(owner, dtype=np.int64), (P,))
        flat = ((d * self.max_groups + self._groups(B, P, group)) * self.max_depth)[
            :, :, None
        ] + depth
        decay = np.ones(self.hits.shape[0], dtype=np.float32)
        decay[d] = self.decay
        self.hits *= decay[:, None, None]
        self.tries *= decay[:, None, None]
        # one add per entry, in order (as index_add_): repeated adds round like the torch ones
        np.add.at(self.hits.reshape(-1), flat.reshape(-1), hit.reshape(-1).astype(np.float32))
        np.add.at(self.tries.reshape(-1), flat.reshape(-1), tried.reshape(-1).astype(np.float32))


_NO_GROUP = np.zeros((1, 1), np.int64)


def best_budget_np(values, cost, max_nodes: int, overhead_s: float = 0.0, batch_cost=None) -> int:
    """``best_budget`` (the tests' torch oracle) on the host: the one K (nodes per row) for the batch.

    Args:
        values: ``[B, M]`` estimated acceptance probability of every candidate node (0 for
            padding).
        cost: a ``CostCurve``, or its table ``cost.table(n, "cpu").numpy()`` (``c(0..n)``,
            float32) with ``n >= B * (min(M, max_nodes) + 1)``.
        max_nodes: upper bound on K.
        overhead_s: fixed per-step seconds outside the forward.
        batch_cost: a ``budget.BatchCost`` (measured batched forwards): for ``B >= 2`` rows the
            cost of K nodes per row is read off it, ``c(B, K + 1)``, instead of ``c(B * (K + 1))``.
    """
    values = np.asarray(values)
    B, M = values.shape
    M = min(M, max_nodes)
    if M == 0 or B == 0:
        return 0
    n = B * (M + 1)
    table = (
        cost.table(n, "cpu").numpy()
        if hasattr(cost, "table")
        else np.asarray(cost, dtype=np.float32)
    )
    if len(table) <= n:
        from redraft.errors import ConfigError

        raise ConfigError(
            f"best_budget_np: the cost table covers c(0..{len(table) - 1}) but a batch of {B} rows "
            f"with {M} candidate nodes needs c({n}); pass cost.table({n}, 'cpu').numpy() or larger."
        )
    if batch_cost is not None and B >= 2:
        secs = batch_cost(B, np.arange(1, M + 2)).astype(np.float32)
    else:
        secs = table[B * np.arange(1, M + 2)]
    if hostjit.ENABLED:
        return int(
            hostjit._best_budget(
                np.ascontiguousarray(values, np.float32),
                M,
                np.ascontiguousarray(secs, np.float32),
                np.float32(overhead_s),
            )
        )
    top = -np.sort(-np.clip(values.astype(np.float32), 0, 1), axis=1)[:, :M]  # [B, M] descending
    total = top[0].copy()
    for b in range(1, B):  # the row sum in float32, row by row (torch's order over dim 0)
        total += top[b]
    gain = np.float32(B) + np.concatenate([[0], np.cumsum(total, dtype=np.float64)]).astype(
        np.float32
    )
    return int(np.argmax(gain / (secs + np.float32(overhead_s))))
