"""Which scaled-dot-product attention kernels the target's forwards may use (CUDA)."""

from __future__ import annotations

import contextlib


def sdpa_backends(device, flash: bool = False):
    """The attention kernels the forwards may use: on CUDA the memory-efficient kernel (it takes
    an explicit mask) and the math fallback, never cuDNN's plan-per-shape path (module doc);
    ``flash`` adds FlashAttention (for callers without a tree mask: ``redraft-bench``'s
    Hugging Face baselines). Reusable across ``with`` blocks."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return _Reusable(lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION] * flash + kinds))


class _Reusable:
    """A context manager made fresh on every ``with`` (``sdpa_kernel`` is single-use)."""

    def __init__(self, make):
        self.make, self.cm = make, None

    def __enter__(self):
        self.cm = self.make()
        return self.cm.__enter__()

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)
