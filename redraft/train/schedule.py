"""The learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio``.

Why not ``transformers.get_cosine_with_min_lr_schedule_with_warmup``: on a step count it is the
same curve one step later (a test checks ``ours(s) == hf(s + 1)`` for an integer warm-up), so its
first optimizer step runs at lr 0 (a wasted batch) and its last one above the minimum; and it
cannot follow a time budget (``schedule_by_time``: progress = elapsed / budget, so a bounded CPU
run still finishes its decay), which a function of the step count alone cannot express.
"""

from __future__ import annotations

import math


class WarmupCosine:
    """Linear warm-up then cosine decay, as a function of training progress in [0, 1].

    Progress is ``(step + 1) / total_steps`` (the step about to be taken), or with a time budget
    ``max(that, elapsed / budget)``. ``factor(p) = p / w`` while ``p < w`` (w = warmup_ratio),
    then ``min + (1 - min) * (1 + cos(pi * (p - w) / (1 - w))) / 2``.
    DeepSpeed calls :meth:`step` after each optimizer step and checkpoints :meth:`state_dict`.
    """

    def __init__(
        self,
        optimizer,
        total_steps: int,
        warmup_ratio: float,
        min_lr_ratio: float = 0.0,
        time_budget_s: float | None = None,
    ):
        self.optimizer = optimizer
        self.total_steps = max(1, int(total_steps))
        self.warmup_ratio = warmup_ratio
        self.min_lr_ratio = min_lr_ratio
        self.time_budget_s = time_budget_s
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.step_count = 0
        self.elapsed_s = 0.0  # set by the trainer before each optimizer step
        self._apply()

    def progress(self) -> float:
        p = (self.step_count + 1) / self.total_steps  # the step about to be taken
        if self.time_budget_s:
            p = max(p, self.elapsed_s / self.time_budget_s)
        return min(p, 1.0)

    def factor(self) -> float:
        p, w = self.progress(), self.warmup_ratio
        if w > 0 and p < w:
            return p / w
        q = (p - w) / (1 - w) if w < 1 else 1.0
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (
            1 + math.cos(math.pi * min(1.0, q))
        )

    def _apply(self) -> None:
        f = self.factor()
        for g, lr in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = lr * f

    def step(self, *args, **kwargs) -> None:
        self.step_count += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {
            "step_count": self.step_count,
            "elapsed_s": self.elapsed_s,
            "base_lrs": self.base_lrs,
        }

    def load_state_dict(self, state: dict) -> None:
        self.step_count = state["step_count"]
        self.elapsed_s = state["elapsed_s"]
        self.base_lrs = state["base_lrs"]
        self._apply()
