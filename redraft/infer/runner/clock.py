"""Step timestamps: CUDA events on a GPU, ``perf_counter`` on a CPU."""

from __future__ import annotations

import time

import torch


class Clock:
    """Step timestamps: CUDA events on a GPU (read after the step's one host read, no extra
    sync), ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a
