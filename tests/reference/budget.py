"""The node budget and the acceptance rates in torch: the tests' oracles for the host code
(``redraft.infer.spec.hostdraft``: :func:`best_budget` for ``best_budget_np``,
:class:`AcceptanceStats` for ``HostStats``), which is what the decoder runs.
"""

from __future__ import annotations

import torch

from redraft.infer.runner.cost import CostCurve


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


class AcceptanceStats:
    """Running acceptance rate per (drafter, path group, depth), with a Beta prior, on a device.

    ``rate[d, g, l]`` estimates P(the entry at depth l of a drafter-d path of group g is
    accepted | its parent was). A path's group is what its drafter says it is
    (``Draft.group``, e.g. the length of the context match behind it), else its rank. Counts
    decay (``decay`` per update of a drafter) so the estimate follows the request.

    The Beta prior (``prior_weight`` pseudo-tries) has the mean ``prior_rate`` at depth 0 and,
    below it, the estimated rate of the depth above (as ``HostStats.rates``).
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
