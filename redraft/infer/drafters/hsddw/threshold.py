"""HSDDW's self-verify: the per-request entropy threshold ``tau`` a draft model stops at."""

from __future__ import annotations

import torch


class EntropyThreshold:
    """Per-request ``tau``: the running mean entropy of rejected draft tokens, starting at ``init``.

    ``tau[b] = mean(entropies of the draft tokens rejected so far in row b)``, ``init`` (0 by
    default) before any rejection. A draft model must stop before a token whose distribution has
    entropy ``H > tau`` (:meth:`exceeds` for a batch, :meth:`stop` for one row).
    """

    def __init__(self, batch_size: int, init: float = 0.0, device=None):
        self.init = float(init)
        self.total = torch.zeros(batch_size, dtype=torch.float64, device=device)
        self.count = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def tau(self) -> torch.Tensor:
        """``[B]`` float64 thresholds."""
        return torch.where(
            self.count > 0,
            self.total / self.count.clamp_min(1),
            torch.full_like(self.total, self.init),
        )

    def exceeds(self, h: torch.Tensor) -> torch.Tensor:
        """``h [B]`` or ``[B, K]`` entropies -> bool, ``h > tau`` of each row."""
        tau = self.tau
        return h.double() > (tau if h.dim() == 1 else tau[:, None])

    def stop(self, row: int, h: float) -> bool:
        """Must row ``row`` stop before a token drafted at entropy ``h``? (One row, on the host.)"""
        return h > float(self.tau[row])

    def reject(self, rows, entropies) -> None:
        """Record rejected draft tokens: rows ``[n]`` and the entropies they were drafted at."""
        dev = self.total.device
        rows = torch.as_tensor(rows, dtype=torch.long, device=dev).reshape(-1)
        ent = torch.as_tensor(entropies, dtype=torch.float64, device=dev).reshape(-1)
        self.total.index_add_(0, rows, ent)
        self.count.index_add_(0, rows, torch.ones_like(rows))

    def reject_where(self, mask: torch.Tensor, entropies: torch.Tensor) -> None:
        """Record one rejected token for every row where ``mask [B]`` holds, drafted at
        ``entropies [B]`` (other rows unchanged)."""
        self.total += torch.where(mask, entropies.double(), torch.zeros_like(self.total))
        self.count += mask.long()

    def select_rows(self, keep) -> None:
        keep = torch.as_tensor(keep, dtype=torch.long, device=self.total.device)
        self.total, self.count = self.total[keep], self.count[keep]

    def add_rows(self, n: int) -> None:
        self.total = torch.cat([self.total, self.total.new_zeros(n)])
        self.count = torch.cat([self.count, self.count.new_zeros(n)])
