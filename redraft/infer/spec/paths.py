"""Paths: the token sequences drafters propose, ``[..., L]`` arrays right-padded with ``PAD``.

The lowest module of the speculation room: the runner, the engine, the host kernels and every
drafter read ``PAD`` from here (a path ends at its first ``PAD``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

PAD = -1  # "no token" in paths and token buffers


def pad_paths(tokens: torch.Tensor, length: int) -> torch.Tensor:
    """Right-pad (or cut) ``[..., L]`` paths to ``length`` with ``PAD``."""
    cur = tokens.shape[-1]
    if cur == length:
        return tokens
    if cur > length:
        return tokens[..., :length]
    pad = tokens.new_full((*tokens.shape[:-1], length - cur), PAD)
    return torch.cat([tokens, pad], dim=-1)


def clean_paths(tokens: torch.Tensor) -> torch.Tensor:
    """Make every token after a path's first ``PAD`` (or negative id) a ``PAD`` too."""
    valid = (tokens >= 0).long().cumprod(dim=-1).bool()
    return tokens.masked_fill(~valid, PAD)


def pad_paths_np(a: np.ndarray, length: int, fill=PAD) -> np.ndarray:
    """Right-pad (or cut) ``[..., L]`` paths to ``length``."""
    cur = a.shape[-1]
    if cur >= length:
        return a[..., :length]
    return np.concatenate([a, np.full((*a.shape[:-1], length - cur), fill, a.dtype)], axis=-1)


# small index tensors every step needs, made once per shape and device (each torch op on a small
# tensor costs microseconds of host time; the decoder's step is a few hundred of them)
@functools.lru_cache(maxsize=256)
def cached_arange(n: int, device) -> torch.Tensor:
    """``torch.arange(n)`` on ``device``, made once (callers must not write into it)."""
    return torch.arange(n, device=device)
