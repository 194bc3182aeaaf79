"""What a run reports while it trains: a :class:`Meter` and experiment :class:`Trackers`.

The meter keeps the figures between two log lines on the device (loss, per-step loss, top-1 /
top-5 through :class:`~redraft.train.losses.EvalAccumulator`) and reads them on the host once per
log line, as nanoGPT does: no ``.item()`` per micro batch, so a GPU never waits on the host.

Trackers are accelerate's (``accelerate.tracking``): ``report_to`` picks any of
``tensorboard`` (event files in ``<output_dir>/tensorboard``), ``wandb``, ``mlflow``, or ``none``.
accelerate is used for this alone (DeepSpeed runs the training): its trackers give one ``log``
call for every backend and handle each one's quirks, which we would otherwise copy.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from redraft.train.losses import EvalAccumulator

TB_DIR = "tensorboard"


class Trackers:
    """accelerate trackers, made on rank 0 only (no-ops elsewhere and with ``report_to: none``).

    ``log`` takes scalars and lists; a list ``[a, b, ...]`` under ``k`` is logged as ``k/pos0``,
    ``k/pos1``, ... (per draft position).
    """

    def __init__(
        self, names: list[str], out: Path, run_name: str, config: dict, enabled: bool = True
    ):
        self.trackers = []
        if not enabled or not names:
            return
        from accelerate import PartialState
        from accelerate.tracking import MLflowTracker, TensorBoardTracker, WandBTracker

        # accelerate's trackers log through its process state; with the process group already
        # made by DeepSpeed it only reads the ranks, but on multi-process CPU runs it would also
        # reset the torch thread count, which --threads owns: keep ours.
        threads = torch.get_num_threads()
        PartialState()
        torch.set_num_threads(threads)
        for name in names:
            if name == "tensorboard":
                t = TensorBoardTracker("", out / TB_DIR)  # events directly in <out>/tensorboard
            elif name == "wandb":
                t = WandBTracker("redraft", name=run_name, dir=str(out))
            else:
                t = MLflowTracker("redraft", run_name=run_name)
            if hasattr(t, "start"):  # accelerate >= 1.x starts trackers lazily
                t.start()
            if name != "tensorboard":  # TensorBoard keeps the config as run_config.yaml beside it
                t.store_init_configuration(
                    {
                        k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
                        for k, v in config.items()
                    }
                )
            self.trackers.append(t)

    def log(self, values: dict, step: int) -> None:
        flat = {}
        for k, v in values.items():
            if isinstance(v, (list, tuple)):
                flat.update({f"{k}/pos{i}": float(x) for i, x in enumerate(v)})
            elif v is not None:
                flat[k] = v
        for t in self.trackers:
            t.log(flat, step=step)

    def close(self) -> None:
        for t in self.trackers:
            t.finish()
        self.trackers = []


def memory_mb(device: torch.device) -> float:
    """Peak CUDA memory, or this process's resident memory on CPU, in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        return float("nan")


class Meter:
    """Training figures since the last log line, summed on ``device`` and read by :meth:`read`.

    Per micro batch :meth:`add` (loss, per-step loss and counts, tokens); on logged optimizer
    steps also :meth:`add_accuracy` (top-1 / top-5 against the data, over the same batches).
    """

    def __init__(self, num_steps: int, device: torch.device):
        self.n, self.device = num_steps, device
        self.reset()

    def reset(self) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.step_loss = torch.zeros(self.n, dtype=torch.float64, device=self.device)
        self.step_count = torch.zeros(self.n, dtype=torch.float64, device=self.device)
        self.acc = EvalAccumulator(self.n, device=self.device)
        self.micro = 0
        self.tokens = 0
        self.top5_seen = True  # False once add_top1 (no top-5) has been used
        self.grad_norm: torch.Tensor | None = None
        self.t0 = time.perf_counter()

    @torch.no_grad()
    def add(self, loss: torch.Tensor, stats: dict, tokens: int) -> None:
        """One micro batch: its loss (a 0-dim tensor), ``drafter_loss``'s stats, real tokens."""
        self.loss += loss.detach()
        self.step_loss += stats["step_loss"] * stats["step_count"]
        self.step_count += stats["step_count"]
        self.micro += 1
        self.tokens += tokens

    @torch.no_grad()
    def add_accuracy(
        self, logits: torch.Tensor, targets_draft: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """Top-1 / top-5 hits of ``logits`` [P, n, Vd] against ``targets_draft`` [P, n]."""
        if len(logits):
            self.acc.add(
                logits.detach(), targets_draft, targets_draft, torch.ones_like(valid), valid
            )

    @torch.no_grad()
    def add_top1(self, top1: torch.Tensor, valid: torch.Tensor) -> None:
        """Top-1 hits ``[P, n]`` bool (the fused loss gives them; it has no top-5)."""
        self.acc.sums[0] += valid.double().sum(0)
        self.acc.sums[1] += (top1 & valid).double().sum(0)
        self.top5_seen = False

    def read(self, env) -> dict:
        """The figures as host numbers (the one host sync per log line); tokens/s summed over ranks."""
        dt = max(time.perf_counter() - self.t0, 1e-9)
        tok_s = env.all_reduce(
            torch.tensor([self.tokens / dt], dtype=torch.float64, device=self.device)
        )
        step_loss = (self.step_loss / self.step_count.clamp(min=1)).tolist()
        acc = self.acc.sums.cpu()  # rows: valid, top1, top5, ...
        seen = acc[0].clamp(min=1)
        has_acc = bool(acc[0].sum() > 0)
        return {
            "train/loss": float(self.loss) / max(1, self.micro),
            "train/step_loss": step_loss,
            "train/top1": (acc[1] / seen).tolist() if has_acc else None,
            "train/top5": (acc[2] / seen).tolist() if has_acc and self.top5_seen else None,
            "train/grad_norm": None if self.grad_norm is None else float(self.grad_norm),
            "train/tokens_per_s": float(tok_s),
        }


def clock(seconds: float) -> str:
    """``m:ss`` (or ``h:mm:ss``) of a duration, as tqdm writes it."""
    s = max(0, round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class TrainBar:
    """The training progress bar: what is left of the run, by what will actually end it.

    A run ends at its step total or at its time budget (``max_time_minutes``), whichever comes
    first. Without a budget the bar counts steps against the step total (tqdm's own ETA). With
    one it counts seconds: the run's end is expected at ``min(budget, elapsed + steps left /
    steps per second)``, so a bounded CPU run whose step total is out of reach shows the budget
    (``3:26 of 8:00, 4:34 left``), and a run whose steps run out first shows their end. The
    steps done, their rate and the last logged figures follow as text.

    Args:
        total_steps: the run's step total (``max_steps`` or epochs x steps per epoch).
        budget_s: the time budget in seconds, or None.
        step0, elapsed0: where a resumed run starts (steps done, seconds spent).
        enabled: False on ranks other than 0 (nothing is drawn).
    """

    def __init__(
        self,
        total_steps: int,
        budget_s: float | None,
        step0: int = 0,
        elapsed0: float = 0.0,
        enabled: bool = True,
    ):
        from tqdm.auto import tqdm

        self.total_steps, self.budget_s = total_steps, budget_s
        self.step0, self.elapsed0 = step0, elapsed0
        self.step, self.elapsed = step0, elapsed0
        self.figures = ""
        if budget_s is None:
            self.bar = tqdm(
                total=total_steps,
                initial=step0,
                disable=not enabled,
                unit="step",
                dynamic_ncols=True,
                desc="train",
            )
        else:
            self.bar = tqdm(
                total=budget_s,
                initial=min(elapsed0, budget_s),
                disable=not enabled,
                dynamic_ncols=True,
                # tqdm puts ", " before a postfix: the text goes in as the description instead
                bar_format="train: {percentage:3.0f}%|{bar}| {desc}",
            )

    def expected_end_s(self) -> float:
        """Seconds from the run's start at which it is expected to end (the budget, or sooner
        where the step total runs out first at the rate so far)."""
        if self.budget_s is None:
            return math.inf
        done, spent = self.step - self.step0, self.elapsed - self.elapsed0
        if done <= 0 or spent <= 0:
            return self.budget_s
        by_steps = self.elapsed + (self.total_steps - self.step) * spent / done
        return min(self.budget_s, by_steps)

    def text(self, final: bool = False) -> str:
        """What the bar says after its percentage (with a time budget); ``final``: once ended."""
        end = self.expected_end_s()
        spent = self.elapsed - self.elapsed0
        rate = (self.step - self.step0) / spent if spent > 0 else 0.0
        if final:
            when = f"{clock(self.elapsed)} (budget {clock(self.budget_s)})"
        else:
            limit = "budget" if end >= self.budget_s else f"{self.total_steps:,} steps"
            when = (
                f"{clock(self.elapsed)} of {clock(end)} ({limit}), {clock(end - self.elapsed)} left"
            )
        out = f"{when}; step {self.step:,}, {rate:.1f} steps/s"
        return out + (f", {self.figures}" if self.figures else "")

    def update(self, step: int, elapsed: float) -> None:
        """After an optimizer step: ``step`` steps done, ``elapsed`` seconds of the run spent."""
        self.step, self.elapsed = step, elapsed
        if self.budget_s is None:
            self.bar.update(step - self.bar.n)
            return
        self.bar.total = self.expected_end_s()
        self.bar.set_description_str(self.text(), refresh=False)
        self.bar.update(min(elapsed, self.bar.total) - self.bar.n)  # tqdm redraws at its interval

    def set_figures(self, **figures: str) -> None:
        """The last logged figures (loss, tokens/s, lr), shown after the steps."""
        if self.budget_s is None:
            self.bar.set_postfix(**figures)
        else:
            self.figures = ", ".join(f"{k} {v}" for k, v in figures.items())

    def close(self) -> None:
        if self.budget_s is not None:
            self.bar.total = self.bar.n = max(self.elapsed, 1e-9)  # ended: 100% of what it took
            self.bar.set_description_str(self.text(final=True), refresh=False)
            self.bar.refresh()
        self.bar.close()
