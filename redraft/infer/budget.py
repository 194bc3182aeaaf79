"""How big a tree to verify: the device's verify-cost curve and per-drafter acceptance rates.

Verifying n tokens in one forward costs ``c(n)``; on a CPU in float32 c(64) is ~4x c(1), in
bfloat16 with AMX or on a GPU it is nearly flat. Each candidate node has an estimated probability
``v`` of being accepted (the product, along its path, of the observed acceptance rate of its
drafter at that depth and path rank). With nodes sorted by value, verifying the top K yields
``1 + sum(v_1..v_K)`` tokens per call, so the decoder picks the K that maximises
``(1 + sum v) / c(K + 1)``: the most expected tokens per unit of verify time.
"""

from __future__ import annotations

import time

import torch

SIZES = (1, 2, 4, 8, 16, 32, 64)


class CostCurve:
    """Piecewise-linear verify cost ``c(n)`` (seconds) from measured points."""

    def __init__(self, sizes, seconds):
        self.sizes = torch.tensor(list(sizes), dtype=torch.float64)
        self.seconds = torch.tensor(list(seconds), dtype=torch.float64)

    def __call__(self, n: torch.Tensor) -> torch.Tensor:
        """Interpolated cost of forwards with ``n`` tokens (any shape; extrapolates linearly)."""
        n = n.to(torch.float64).cpu()
        x, y = self.sizes, self.seconds
        i = torch.searchsorted(x, n.clamp(x[0], x[-1])).clamp(1, len(x) - 1)
        x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
        return y0 + (n - x0) * (y1 - y0) / (x1 - x0)

    def to_dict(self) -> dict:
        return {"sizes": self.sizes.long().tolist(), "ms": [round(s * 1e3, 2) for s in self.seconds.tolist()]}

    @classmethod
    def flat(cls) -> "CostCurve":
        """A cost that does not depend on n (use the whole draft)."""
        return cls([1, 1024], [1.0, 1.0])


@torch.no_grad()
def measure_cost_curve(forward, sizes=SIZES, repeats: int = 3) -> CostCurve:
    """Time ``forward(n)`` (one verify forward of n tokens) for each n; the fastest of ``repeats``
    (other processes only ever add time, so the minimum is the device's own cost).

    ``forward`` runs the target on n tokens over a cache of realistic length and returns nothing;
    the decoder passes one that builds a throw-away cache, so nothing of its state is touched.
    """
    secs = []
    forward(sizes[0])  # warm-up (allocator, kernels)
    for n in sizes:
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            forward(n)
            ts.append(time.perf_counter() - t0)
        secs.append(min(ts))
    # the cost never decreases with n: smooth what noise is left
    secs = torch.tensor(secs).cummax(dim=0).values.tolist()
    return CostCurve(sizes, secs)


def best_budget(values: torch.Tensor, cost: CostCurve, max_nodes: int, overhead_s: float = 0.0) -> torch.Tensor:
    """Nodes to verify per row.

    Args:
        values: ``[B, M]`` estimated acceptance probability of every candidate node.
        cost: the verify cost curve.
        max_nodes: upper bound on nodes (root excluded).
        overhead_s: fixed per-step time outside the forward (drafting, acceptance).

    Returns:
        ``[B]`` long K maximising ``(1 + sum of the K largest values) / (cost(K+1) + overhead)``.
    """
    B, M = values.shape
    M = min(M, max_nodes)
    if M == 0:
        return torch.zeros(B, dtype=torch.long, device=values.device)
    top = values.float().clamp(0, 1).topk(M, dim=1).values.cpu().double()  # [B, M] desc
    gain = torch.cat([torch.ones(B, 1, dtype=torch.float64), 1 + top.cumsum(dim=1)], dim=1)  # K=0..M
    secs = cost(torch.arange(1, M + 2)) + overhead_s  # [M+1]
    return (gain / secs[None]).argmax(dim=1).to(values.device)


class AcceptanceStats:
    """Running acceptance rate per (drafter, path group, depth), with a Beta prior.

    ``rate[d, g, l]`` estimates P(the entry at depth l of a drafter-d path of group g is
    accepted | its parent was). A path's group is what its drafter says it is
    (``Draft.group``, e.g. the length of the context match behind it), else its rank. Counts
    decay (``decay`` per update) so the estimate follows the request.
    """

    def __init__(self, num_drafters: int, max_groups: int = 32, max_depth: int = 16,
                 prior_rate: float = 0.3, prior_weight: float = 2.0, decay: float = 0.98):
        shape = (num_drafters, max_groups, max_depth)
        self.max_groups, self.max_depth, self.decay = max_groups, max_depth, decay
        self.prior = (prior_rate * prior_weight, prior_weight)
        self.hits = torch.zeros(shape, dtype=torch.float64)
        self.tries = torch.zeros(shape, dtype=torch.float64)

    def reset(self) -> None:
        self.hits.zero_()
        self.tries.zero_()

    def rates(self) -> torch.Tensor:
        return (self.hits + self.prior[0]) / (self.tries + self.prior[1])

    def _groups(self, shape: tuple[int, int, int], group: torch.Tensor | None) -> torch.Tensor:
        B, P, _ = shape
        g = torch.arange(P)[None].expand(B, P) if group is None else group.cpu().long()
        return g.clamp(0, self.max_groups - 1)

    def values(self, drafter: int, shape: tuple[int, int, int], group: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, P, L]`` path-product of rates for a drafter's paths of ``shape`` (groups
        ``group [B, P]``, default the path rank)."""
        B, P, L = shape
        r = self.rates()[drafter].float()  # [G, Dm]
        depths = torch.arange(L).clamp(max=self.max_depth - 1)
        per = r[self._groups(shape, group)][:, :, depths]  # [B, P, L]
        return per.cumprod(dim=2)

    def update(self, drafter: int, tokens: torch.Tensor, accepted_prefix: torch.Tensor,
               group: torch.Tensor | None = None) -> None:
        """``tokens [B, P, L]`` the drafter's paths, ``accepted_prefix [B, P]`` tokens accepted,
        ``group [B, P]`` their groups (default: rank)."""
        B, P, L = tokens.shape
        if P == 0:
            return
        depth = torch.arange(L, device=tokens.device)
        valid = tokens >= 0
        tried = (valid & (depth[None, None] <= accepted_prefix[:, :, None])).cpu()  # parent accepted
        hit = (valid & (depth[None, None] < accepted_prefix[:, :, None])).cpu()
        L_ = min(L, self.max_depth)
        g = self._groups(tokens.shape, group)[:, :, None].expand(B, P, L_).reshape(-1)
        d = depth.cpu()[:L_][None, None].expand(B, P, L_).reshape(-1)
        flat = g * self.max_depth + d
        self.hits[drafter] *= self.decay
        self.tries[drafter] *= self.decay
        self.hits[drafter].view(-1).index_add_(0, flat, hit[:, :, :L_].reshape(-1).double())
        self.tries[drafter].view(-1).index_add_(0, flat, tried[:, :, :L_].reshape(-1).double())
