"""Held-out evaluation's report: the line a run prints after each evaluation, and the metrics of
a finished drafter artifact (no training, nothing written)."""

from __future__ import annotations

import torch

from redraft.errors import ConfigError
from redraft.train.batches import check_dataset, load_datasets
from redraft.train.config import TrainConfig
from redraft.train.distilled import distilled_data
from redraft.train.distributed import setup_distributed
from redraft.train.fingerprint import target_record
from redraft.train.precision import resolve_precision, target_dtype
from redraft.train.step import evaluate


def eval_line(step: int, m: dict) -> str:
    top1 = " ".join(f"{a:.3f}" for a in m["eval_top1"])
    top1t = " ".join(f"{a:.3f}" for a in m["eval_top1_target"])
    return (
        f"[eval @ step {step}] loss {m['eval_loss']:.3f} | top-1 by position (data) {top1} | "
        f"(target greedy) {top1t} | tau_est {m['eval_tau_est']:.3f} (vs data {m['eval_tau_est_data']:.3f})"
    )


def evaluate_artifact(cfg: TrainConfig, path=None, target=None, eval_dataset=None) -> dict:
    """Held-out metrics of a finished drafter artifact (``path`` or ``cfg.init_from``) on
    ``cfg.eval_data`` / the held-out split of ``cfg.data``; no training, nothing written."""
    from redraft.models.drafter_io import load_drafter

    path = path or cfg.init_from
    if not path:
        raise ConfigError(
            "Evaluation needs a drafter artifact: pass --init-from DIR (or REPO_ID).",
            param="init_from",
        )
    env = setup_distributed(cfg)
    precision = resolve_precision(cfg, env.device)
    if target is None:
        from redraft.models import load_target

        target = load_target(
            cfg.target, dtype=target_dtype(precision, env.device), device=env.device
        )
    if eval_dataset is None:
        data_cfg = distilled_data(cfg, target, target_record(target), env, train=False)
        _, eval_dataset = load_datasets(data_cfg, target.tokenizer, env, train=False)
    check_dataset(eval_dataset, "held-out")
    drafter = load_drafter(path, target, dtype=torch.float32)
    cfg = TrainConfig(
        **{
            **cfg.to_dict(),
            "num_steps": drafter.config.num_steps,
            "adam_betas": tuple(cfg.adam_betas),
        }
    )
    m = evaluate(drafter, drafter, target, eval_dataset, cfg, env, precision)
    env.say(eval_line(0, m).replace("[eval @ step 0]", f"[eval {path}]"))
    return m
