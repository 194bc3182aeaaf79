"""What each pass of the training loop runs around the math: one optimizer step over the micro
batches, the progress line, and the stop check (a signal on any rank, the time budget)."""

from __future__ import annotations

import signal
import sys
import time

import torch

from redraft.models.redrafter import ReDrafter
from redraft.train.batches import micro_batch
from redraft.train.config import TrainConfig
from redraft.train.distributed import DistEnv
from redraft.train.logger import Meter, Trackers, memory_mb
from redraft.train.schedule import WarmupCosine
from redraft.train.step import batch_loss


def optimizer_step(
    engine,
    model: ReDrafter,
    target,
    records,
    global_batch,
    cfg: TrainConfig,
    env: DistEnv,
    modes: tuple[str, str],
    hidden_dtype: torch.dtype,
    meter: Meter,
    sched: WarmupCosine,
    t_start: float,
    log_now: bool,
) -> tuple[int, int]:
    """One optimizer step over this rank's ``grad_accum`` micro batches of ``global_batch``.
    ``modes``: the resolved ``(precision, loss_impl)``.

    Returns ``(tokens, loss_tokens)`` this rank saw (host ints, no device sync).
    """
    tokens = loss_tokens = 0
    precision, impl = modes
    for k in range(cfg.grad_accum):
        batch = records.batch(
            micro_batch(global_batch, k, env.rank, env.world_size, cfg.micro_batch_size), env.device
        )
        loss, stats, logits, win, targets = batch_loss(
            model, engine, target, batch, cfg, precision, hidden_dtype, impl
        )
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary():
            sched.elapsed_s = (
                time.perf_counter() - t_start
            )  # the schedule may follow the time budget
            if log_now and engine.zero_optimization_stage() == 0:  # before step() clears the grads
                meter.grad_norm = torch.linalg.vector_norm(
                    torch.stack(
                        [p.grad.float().norm() for p in model.parameters() if p.grad is not None]
                    )
                )
        engine.step()
        meter.add(loss, stats, batch.tokens)
        if log_now and logits is not None:
            meter.add_accuracy(logits, targets, win.valid)
        elif log_now and "top1" in stats:
            meter.add_top1(stats["top1"], win.valid)
        tokens += batch.tokens
        loss_tokens += batch.loss_tokens
    return tokens, loss_tokens


def log_progress(
    meter: Meter, engine, sched: WarmupCosine, env: DistEnv, trackers: Trackers, bar, step: int
) -> None:
    """Read the meter (one host sync), send it to the trackers and the progress bar (a
    :class:`~redraft.train.logger.TrainBar`), reset it."""
    vals = meter.read(env)
    if engine.zero_optimization_stage() != 0:
        vals["train/grad_norm"] = float(engine.get_global_grad_norm() or 0.0)
    vals["train/lr"] = sched.get_last_lr()[0]
    vals["train/memory_mb"] = memory_mb(env.device)
    trackers.log(vals, step)
    bar.set_figures(
        loss=f"{vals['train/loss']:.3f}",
        tok_s=f"{vals['train/tokens_per_s']:.0f}",
        lr=f"{vals['train/lr']:.2e}",
    )
    meter.reset()


def stop_reason(stop: StopSignal, cfg: TrainConfig, state: dict, env: DistEnv) -> str:
    """``"interrupted"`` (a signal on any rank), ``"time_budget"``, or ``"running"``; the same on
    every rank (one all_reduce)."""
    flags = torch.tensor(
        [
            float(stop.signum != 0),
            float(bool(cfg.max_time_minutes) and state["elapsed_s"] >= cfg.max_time_minutes * 60),
        ],
        device=env.device,
    )  # NCCL reduces no CPU tensors
    env.all_reduce(flags, torch.distributed.ReduceOp.MAX)
    return "interrupted" if flags[0] else ("time_budget" if flags[1] else "running")


class StopSignal:
    """SIGINT/SIGTERM -> finish the current optimizer step, checkpoint, exit; a second one aborts."""

    def __init__(self):
        self.signum = 0
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread: no handlers
                pass
        return self

    def _handle(self, signum, frame):
        if self.signum:  # a second signal: stop now
            raise KeyboardInterrupt
        self.signum = signum
        print(
            f"\nredraft-train: got signal {signum}; checkpointing after this step "
            f"(send it again to abort without a checkpoint)",
            file=sys.stderr,
            flush=True,
        )

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
