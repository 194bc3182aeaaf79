"""The ReDrafter training loop (DeepSpeed), top to bottom.

    train(cfg)
      setup          check settings and the output directory, join the processes (distributed.py),
                     pick the precision (precision.py)
      target, data   the frozen target; training records as tokens (batches.py: the target runs
                     per step) or as cached features (features/: no target forward)
      head, engine   ReDrafter sized for the target; AdamW + warm-up/cosine (schedule.py) inside
                     deepspeed.initialize (build.py); restore the newest checkpoint on --resume
      loop           per optimizer step (loop.py): grad_accum micro batches -> batch_loss
                     (step.py) -> engine.backward / engine.step; meter + trackers (logger.py);
                     stop on a signal or the time budget; evaluate (evaluate.py); checkpoint
                     (checkpoint.py)
      finish         checkpoint, held-out evaluation, the artifact swapped in whole

Only the drafter's parameters are in the optimizer; the target never gets gradients.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from redraft.errors import ConfigError
from redraft.train import checkpoint as ckpt
from redraft.train.batches import (
    TokenRecords,
    check_dataset,
    collate,
    draft_vocab_from_data,
    epoch_batches,
    load_datasets,
    sequence_lengths,
)
from redraft.train.build import build_engine, build_head
from redraft.train.config import TrainConfig, config_diff, for_device, parse_report_to
from redraft.train.distilled import distilled_data
from redraft.train.distributed import DistEnv, setup_distributed
from redraft.train.evaluate import eval_line, evaluate_artifact
from redraft.train.fingerprint import describe, record_mismatch, target_record
from redraft.train.logger import Meter, Trackers, TrainBar, memory_mb
from redraft.train.loop import StopSignal, log_progress, optimizer_step, stop_reason
from redraft.train.precision import autocast, deepspeed_config, resolve_precision, target_dtype
from redraft.train.schedule import WarmupCosine
from redraft.train.step import (
    batch_loss,
    evaluate,
    resolve_loss_impl,
    target_greedy,
    target_hidden,
    warm_start_from_target,
)

# Names importable from here before the trainer was split into modules (kept for callers).
__all__ = [
    "train",
    "evaluate_artifact",
    "DistEnv",
    "setup_distributed",
    "resolve_precision",
    "autocast",
    "target_dtype",
    "deepspeed_config",
    "WarmupCosine",
    "load_datasets",
    "sequence_lengths",
    "draft_vocab_from_data",
    "epoch_batches",
    "collate",
    "target_hidden",
    "target_greedy",
    "warm_start_from_target",
    "batch_loss",
    "evaluate",
    "memory_mb",
]


def train(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    target=None,
    train_dataset=None,
    eval_dataset=None,
    on_step=None,
) -> dict:
    """Train a ReDrafter head; returns the metrics dict (also written to metrics.json).

    Args:
        cfg: the resolved :class:`~redraft.train.config.TrainConfig`.
        resume: continue the run in ``cfg.output_dir`` from its newest checkpoint.
        overwrite: replace a run already in ``cfg.output_dir``.
        target: an already loaded Target (default: ``load_target(cfg.target)``).
        train_dataset, eval_dataset: token datasets (columns input_ids, loss_mask); default
            ``redraft.data.build_token_dataset(cfg.data ...)``. With ``cfg.features`` the
            training records are the cached features and ``train_dataset`` is not used.
        on_step: optional ``callback(state: dict)`` after every optimizer step (tests, hooks).
    """
    run = _setup_run(cfg, resume, overwrite)  # every check that needs no model comes first
    _load_target(run, target)
    _load_records(run, train_dataset, eval_dataset)
    _build_training(run)
    _run_loop(run, on_step)
    metrics = _finish(run)
    _publish(run)
    return metrics


@dataclass
class _Run:
    """What the phases of :func:`train` hand each other (filled in as they run)."""

    cfg: TrainConfig
    out: Path
    env: DistEnv
    precision: str
    loss_impl: str  # the resolved loss implementation (train.step.resolve_loss_impl)
    resuming: bool
    saved: dict | None
    target: Any = None
    record: dict | None = None
    records: Any = None  # TokenRecords or FeatureRecords
    eval_dataset: Any = None
    hidden_dtype: Any = None  # what cached hidden states are cast to
    model: Any = None
    engine: Any = None
    sched: Any = None
    global_batch: int = 0
    steps_per_epoch: int = 0
    total_steps: int = 0
    state: dict = field(default_factory=dict)
    status: str = "running"
    metrics: dict = field(default_factory=dict)
    trackers: Any = None
    run_tokens0: int = 0
    run_t0: float = 0.0


def _setup_run(cfg: TrainConfig, resume: bool, overwrite: bool) -> _Run:
    """Settings, output directory, processes and precision; the saved run config when resuming."""
    cfg.validate()
    out = cfg.resolved_output_dir()
    ckpt.check_output_dir(out)
    if cfg.features:
        from redraft.train.features import read_features_meta

        read_features_meta(cfg.features)  # exists and is finished
        if cfg.kd_features:
            read_features_meta(cfg.kd_features)
    env = setup_distributed(cfg)
    shaped = for_device(cfg, env.device)  # the recipe's GPU micro batch (gpu_micro_batch_size)
    if shaped is not cfg:
        env.say(
            f"redraft-train: on {env.device}, micro batches of {shaped.micro_batch_size} x "
            f"{shaped.grad_accum} accumulated (gpu_micro_batch_size; the recipe's "
            f"{cfg.micro_batch_size} x {cfg.grad_accum} elsewhere): the same batch per process"
        )
        cfg = shaped
    precision = resolve_precision(cfg, env.device)
    loss_impl = resolve_loss_impl(cfg, env.device)
    resuming = ckpt.prepare_output_dir(out, resume, overwrite, env.rank)
    env.barrier()
    saved = ckpt.load_run_config(out) if resuming else None
    if resuming:
        check_same_settings(saved, cfg, out)
    return _Run(cfg, out, env, precision, loss_impl, resuming, saved)


def _load_target(run: _Run, target) -> None:
    """The target (loaded unless given), checked against the settings and a resumed run; the run
    config is written."""
    cfg, env, out = run.cfg, run.env, run.out
    if target is None:
        from redraft.models import load_target

        target = load_target(
            cfg.target, dtype=target_dtype(run.precision, env.device), device=env.device
        )
    if cfg.draft_vocab_size and cfg.draft_vocab_size > target.vocab_size:
        raise ConfigError(
            f"--draft-vocab-size {cfg.draft_vocab_size} is out of range: the target "
            f"{target.model_id!r} has {target.vocab_size} tokens; use at most that, or leave it out "
            f"for the full vocabulary.",
            param="draft_vocab_size",
        )
    record = target_record(target)
    if run.resuming:
        check_same_target(run.saved, record, cfg, out)
    if env.is_main:
        ckpt.save_run_config(out, cfg.to_dict(), record)
        import yaml

        env.say(
            "redraft-train: resolved config\n"
            + yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip()
        )
        env.say(
            f"redraft-train: {env.world_size} process(es), device {env.device}, precision {run.precision}, "
            f"ZeRO {cfg.zero_stage}, loss {cfg.loss} ({run.loss_impl}), output {out}"
        )
    run.target, run.record = target, record


def _load_records(run: _Run, train_dataset, eval_dataset) -> None:
    """The training records (token datasets, or cached features) and the held-out dataset."""
    cfg, env, target, record = run.cfg, run.env, run.target, run.record
    if cfg.features:
        from redraft.train.features import FeatureRecords

        records = FeatureRecords(cfg.features, cfg=cfg, record=run.record)
        env.say(
            f"redraft-train: training from the features cached in {cfg.features} (no target forward)"
        )
        if cfg.kd_features:
            from redraft.train.kdmix import KDOnlyMix

            records = KDOnlyMix.of_features(records, cfg.kd_features, run.record)
            _say_kd_only(env, records, cfg.kd_features)
        if eval_dataset is None:
            data_cfg = distilled_data(cfg, target, record, env, train=False)
            _, eval_dataset = load_datasets(data_cfg, target.tokenizer, env, train=False)
    else:
        if train_dataset is None or eval_dataset is None:
            # self_distill: the target's own replies (made once, then cached) replace the data's
            data_cfg = distilled_data(cfg, target, record, env, train=train_dataset is None)
            tr, ev = load_datasets(data_cfg, target.tokenizer, env, train=train_dataset is None)
            train_dataset = tr if train_dataset is None else train_dataset
            eval_dataset = ev if eval_dataset is None else eval_dataset
        records = TokenRecords(train_dataset)
        if cfg.kd_data:
            from redraft.train.batches import load_kd_dataset
            from redraft.train.kdmix import KDOnlyMix

            kd = check_dataset(load_kd_dataset(cfg, target.tokenizer, env), "--kd-data")
            records = KDOnlyMix(records, TokenRecords(kd))
            _say_kd_only(env, records, f"{cfg.kd_data} (the target reads them online)")
    check_dataset(eval_dataset, "held-out")
    run.records, run.eval_dataset = records, eval_dataset
    run.hidden_dtype = target_dtype(run.precision, env.device)


def _say_kd_only(env, records, source: str) -> None:
    env.say(
        f"redraft-train: + {len(records) - records.n_main} KD-only records "
        f"({records.kd_tokens} tokens) from {source} (the KL term on every token)"
    )


def _build_training(run: _Run) -> None:
    """The head, the optimizer and DeepSpeed, the step count, and the state (from the newest
    checkpoint when resuming)."""
    cfg, env, out, records = run.cfg, run.env, run.out, run.records
    model = build_head(cfg, run.target, records, run.record).to(env.device).train()
    run.global_batch = cfg.micro_batch_size * cfg.grad_accum * env.world_size
    run.steps_per_epoch = len(records) // run.global_batch
    run.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * run.steps_per_epoch))
    run.engine, run.sched = build_engine(cfg, model, run.total_steps, run.precision)
    run.model = model = run.engine.module

    state = {
        "global_step": 0,
        "epoch": 0,
        "batch_in_epoch": 0,
        "tokens": 0,
        "loss_tokens": 0,
        "elapsed_s": 0.0,
    }
    if run.resuming:
        loaded = ckpt.load_checkpoint(run.engine, out, env.rank)
        if loaded is None:
            env.say(
                f"redraft-train: --resume but no checkpoint in {out / ckpt.STATE_DIR}; starting fresh"
            )
        else:
            state.update(loaded)
            env.say(
                f"redraft-train: resumed from step {state['global_step']} (epoch {state['epoch']}, "
                f"batch {state['batch_in_epoch']})"
            )
    env.say(
        f"redraft-train: {len(records)} training records ({int(records.lengths.sum())} tokens), "
        f"{len(run.eval_dataset)} held-out; {model.num_trainable_parameters() / 1e6:.2f}M trainable "
        f"parameters; {run.steps_per_epoch} steps/epoch, {run.total_steps} steps"
        + (
            f" or {cfg.max_time_minutes:g} minutes, whichever ends first"
            if cfg.max_time_minutes
            else ""
        )
    )
    run.state = state


def _run_loop(run: _Run, on_step) -> None:
    """Optimizer steps until the step count, a stop signal or the time budget; evaluation and
    checkpoints on their schedules. Sets ``run.status``."""
    cfg, env, out, state, engine = run.cfg, run.env, run.out, run.state, run.engine
    total_steps = run.total_steps
    meter = Meter(cfg.num_steps, env.device)
    run.trackers = trackers = Trackers(
        parse_report_to(cfg.report_to),
        out,
        cfg.resolved_run_name(),
        cfg.to_dict(),
        enabled=env.is_main,
    )
    status = "running"
    t_start = time.perf_counter() - state["elapsed_s"]
    run.run_tokens0, run.run_t0 = state["tokens"], time.perf_counter()
    # the bar counts against what ends the run: the time budget, unless the steps run out first
    bar = TrainBar(
        total_steps,
        cfg.max_time_minutes * 60 if cfg.max_time_minutes else None,
        state["global_step"],
        state["elapsed_s"],
        enabled=env.is_main,
    )
    with StopSignal() as stop:
        while status == "running" and state["global_step"] < total_steps:
            batches = epoch_batches(
                run.records.lengths, run.global_batch, cfg.seed, state["epoch"], cfg.group_by_length
            )
            while state["batch_in_epoch"] < len(batches):
                log_now = (state["global_step"] + 1) % cfg.log_every == 0
                _step(run, batches[state["batch_in_epoch"]], meter, t_start, log_now)
                bar.update(state["global_step"], state["elapsed_s"])
                if log_now or state["global_step"] == total_steps:
                    log_progress(meter, engine, run.sched, env, trackers, bar, state["global_step"])
                if on_step is not None:
                    on_step(dict(state))
                status = stop_reason(stop, cfg, state, env)
                if status != "running" or state["global_step"] >= total_steps:
                    break
                _evaluate_and_save(run)
            else:  # epoch finished
                state["epoch"] += 1
                state["batch_in_epoch"] = 0
    bar.close()
    run.status = "completed" if status == "running" else status


def _step(run: _Run, batch, meter: Meter, t_start: float, log_now: bool) -> None:
    """One optimizer step on ``batch``; the run's token, step and batch counts and clock advance."""
    state = run.state
    tokens, loss_tokens = optimizer_step(
        run.engine,
        run.model,
        run.target,
        run.records,
        batch,
        run.cfg,
        run.env,
        (run.precision, run.loss_impl),
        run.hidden_dtype,
        meter,
        run.sched,
        t_start,
        log_now,
    )
    state["tokens"] += tokens
    state["loss_tokens"] += loss_tokens
    state["global_step"] += 1
    state["batch_in_epoch"] += 1
    state["elapsed_s"] = time.perf_counter() - t_start


def _evaluate_and_save(run: _Run) -> None:
    """An evaluation and a checkpoint, each when its schedule says so at this step."""
    cfg, env, state = run.cfg, run.env, run.state
    if cfg.eval_every and state["global_step"] % cfg.eval_every == 0:
        run.metrics = evaluate(
            run.model, run.engine, run.target, run.eval_dataset, cfg, env, run.precision
        )
        run.trackers.log({f"eval/{k[5:]}": v for k, v in run.metrics.items()}, state["global_step"])
        env.say(eval_line(state["global_step"], run.metrics))
    if cfg.save_every and state["global_step"] % cfg.save_every == 0:
        ckpt.save_checkpoint(
            run.engine, run.out, state, env.rank, cfg.keep_checkpoints, env.barrier
        )


def _finish(run: _Run) -> dict:
    """Final checkpoint, evaluation, tokens/s over all ranks, metrics.json and the artifact."""
    cfg, env, out, state, engine, model = (
        run.cfg,
        run.env,
        run.out,
        run.state,
        run.engine,
        run.model,
    )
    status, metrics = run.status, run.metrics
    train_time = time.perf_counter() - run.run_t0
    ckpt.save_checkpoint(engine, out, state, env.rank, cfg.keep_checkpoints, env.barrier)
    # on the process's device: NCCL, the multi-GPU backend, reduces no CPU tensors
    tok = torch.tensor(
        [(state["tokens"] - run.run_tokens0) / max(train_time, 1e-9), state["tokens"]],
        dtype=torch.float64,
        device=env.device,
    )
    env.all_reduce(tok)  # summed over ranks: the run's tokens/s and tokens
    if status != "interrupted":
        metrics = evaluate(model, engine, run.target, run.eval_dataset, cfg, env, run.precision)
        run.trackers.log({f"eval/{k[5:]}": v for k, v in metrics.items()}, state["global_step"])
    metrics = {
        "status": status,
        "global_step": state["global_step"],
        "total_steps": run.total_steps,
        "epochs_done": state["epoch"] + state["batch_in_epoch"] / max(1, run.steps_per_epoch),
        "train_tokens": int(tok[1]),
        "train_time_s": state["elapsed_s"],
        "train_tokens_per_s": float(tok[0]),
        "world_size": env.world_size,
        "precision": run.precision,
        "device": str(env.device),
        "features": bool(cfg.features),
        **metrics,
    }
    weights = ckpt.full_state_dict(engine, model)  # collective under ZeRO-3
    if env.is_main:
        ckpt.write_artifact(out, model.config, weights, metrics)
    run.trackers.close()
    if "eval_top1" in metrics:
        env.say(eval_line(state["global_step"], metrics))
    env.say(f"redraft-train: {status} at step {state['global_step']}; artifact in {out}")
    env.say(
        f"redraft-train: use it with  load_drafter({str(out)!r}, load_target({cfg.target!r}))  "
        f"(redraft.models.redrafter), or benchmark it: redraft-bench --methods greedy,redrafter --drafter {out}"
    )
    return metrics


def _publish(run: _Run) -> None:
    """``push_to_hub``: the finished artifact, from the main process; then every rank meets."""
    cfg, env = run.cfg, run.env
    if cfg.push_to_hub and env.is_main and run.status != "interrupted":
        from redraft.hub import push_artifact

        url = push_artifact(
            run.out, cfg.push_to_hub, private=cfg.hub_private, revision=cfg.hub_revision
        )
        env.say(f"redraft-train: pushed to {url}")
    env.barrier()


# ------------------------------------------------------------------------------ the steps of train()


def check_same_settings(saved: dict | None, cfg: TrainConfig, out: Path) -> None:
    """--resume: every setting that shapes the run must equal the saved run's."""
    diff = config_diff(saved or {}, cfg)
    if diff:
        raise ConfigError(
            f"--resume: these settings differ from the run saved in {out / ckpt.RUN_CONFIG}: "
            + ", ".join(f"{k} (saved {saved[k]!r}, now {getattr(cfg, k)!r})" for k in diff)
            + ". Resume with the same settings, or start a new run (--overwrite / another --output-dir).",
            param=diff[0],
        )


def check_same_target(saved: dict | None, record: dict, cfg: TrainConfig, out: Path) -> None:
    """--resume: the target must be the run's (tokenizer and weights fingerprints), whatever its
    spelling (a moved directory, a hub id for a local copy)."""
    before = (saved or {}).get("target_record")
    if before and record_mismatch(before, record):
        raise ConfigError(
            f"--resume: the run in {out} was trained on target {describe(before)}, but --target "
            f"{cfg.target!r} is {describe(record)}. Resume with the run's own target, or start a new run "
            f"(--overwrite / another --output-dir).",
            param="target",
        )
