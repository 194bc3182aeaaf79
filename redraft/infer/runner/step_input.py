"""The one step-input format: what the host uploads for a verify forward, in one copy.

The engine packs the step's tree and the rows' cache lengths into :class:`StepInput` (one int64
tensor); the verifier derives everything the forward needs from it inside the forward (ids,
positions ``length + depth``, the 4D tree mask, the cache columns), so on CUDA it is part of the
captured graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepInput:
    """One step's device input, uploaded by the host in one copy: ``packed [B, 1 + 3N + N*N]``
    long = per row ``[cache length | tokens (N) | depth (N) | parent (N) | ancestor mask (N*N,
    0/1)]``; node 0 is the root (the token the target produced last), ``tokens`` < 0 are padding
    nodes. The fields are views."""

    packed: torch.Tensor
    size: int  # N

    @property
    def lengths(self) -> torch.Tensor:
        return self.packed[:, 0]

    @property
    def tokens(self) -> torch.Tensor:
        return self.packed[:, 1 : 1 + self.size]

    @property
    def depth(self) -> torch.Tensor:
        return self.packed[:, 1 + self.size : 1 + 2 * self.size]

    @property
    def parent(self) -> torch.Tensor:
        return self.packed[:, 1 + 2 * self.size : 1 + 3 * self.size]

    @property
    def anc(self) -> torch.Tensor:
        """``[B, N, N]`` long 0/1."""
        N = self.size
        return self.packed[:, 1 + 3 * N :].view(-1, N, N)

    @staticmethod
    def width(size: int) -> int:
        return 1 + 3 * size + size * size


def chain_step(lengths: list[int], n: int, device, token: int = 0) -> StepInput:
    """A :class:`StepInput` of one chain of ``n`` tokens per row (for measurements and tests)."""
    B = len(lengths)
    ar = torch.arange(n)
    packed = torch.cat(
        [
            torch.tensor(lengths)[:, None],
            torch.full((B, n), token),
            ar.expand(B, n),
            (ar - 1).expand(B, n),
            torch.tril(torch.ones(n, n, dtype=torch.long)).reshape(1, -1).expand(B, -1),
        ],
        dim=1,
    )
    return StepInput(packed.to(device), n)
