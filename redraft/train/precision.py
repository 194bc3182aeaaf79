"""Precision (which dtypes the head, its optimizer and the target run in) and the DeepSpeed config.

    precision    head weights / optimizer                  compute
    fp32         fp32 / fp32                               fp32
    amp-bf16     fp32 / fp32                               bf16 autocast (CPU AMX, GPUs)
    bf16         bf16 / fp32 master copy under ZeRO >= 1    bf16 (DeepSpeed)
    fp16         fp16 / fp32 master copy, loss scaling      fp16 (DeepSpeed)

The frozen target's forward runs under bf16 autocast (fp16 for ``fp16``) unless ``fp32``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch

from redraft.errors import ConfigError
from redraft.train.config import TRAIN_DIR, TrainConfig

logger = logging.getLogger(__name__)


def resolve_precision(cfg: TrainConfig, device: torch.device) -> str:
    """``auto``: DeepSpeed bf16 (bf16 weights, fp32 master weights in the ZeRO optimizer) on GPUs
    with ZeRO >= 1; otherwise ``amp-bf16`` (fp32 weights, bf16 autocast), because DeepSpeed's
    bf16 without ZeRO keeps no fp32 master weights and small updates would be rounded away."""
    if cfg.precision != "auto":
        if cfg.precision == "bf16" and cfg.zero_stage == 0 and not cfg.deepspeed_config:
            logger.warning(
                "precision bf16 with ZeRO stage 0 trains pure bf16 weights (no fp32 master "
                "copy); prefer amp-bf16 or zero_stage >= 1"
            )
        return cfg.precision
    return "bf16" if device.type == "cuda" and cfg.zero_stage >= 1 else "amp-bf16"


def autocast(device: torch.device, precision: str):
    """bf16 autocast for 'amp-bf16' (and for the target forward whenever precision is not fp32).

    On CPUs with AMX, bf16 matmuls over many tokens are several times faster than fp32.
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


def head_autocast(device: torch.device, precision: str):
    """The drafter's own forward: autocast only for 'amp-bf16' (DeepSpeed casts bf16/fp16 itself)."""
    return autocast(device, precision) if precision == "amp-bf16" else contextlib.nullcontext()


def target_dtype(precision: str, device: torch.device) -> torch.dtype:
    """dtype of the frozen target's weights (and so of its hidden states) for ``precision``."""
    if device.type == "cuda":
        return (
            torch.float16
            if precision == "fp16"
            else (torch.float32 if precision == "fp32" else torch.bfloat16)
        )
    return torch.float32  # CPU: fp32 weights, bf16 compute under autocast


def deepspeed_config(cfg: TrainConfig, precision: str) -> dict:
    """The JSON config (train/ds_zero<stage>.json or --deepspeed-config) with 'auto' values filled."""
    path = (
        Path(cfg.deepspeed_config)
        if cfg.deepspeed_config
        else TRAIN_DIR / f"ds_zero{cfg.zero_stage}.json"
    )
    if not path.is_file():
        raise ConfigError(
            f"DeepSpeed config {path} does not exist; pass --deepspeed-config FILE or a "
            f"--zero-stage whose train/ds_zero<stage>.json exists.",
            param="deepspeed_config",
        )
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"DeepSpeed config {path} is not valid JSON: {exc}", param="deepspeed_config"
        ) from exc
    fill = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
    }
    for key, val in fill.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = val
        elif ds[key] != val:
            raise ConfigError(
                f"{path} sets {key}={ds[key]} but the training config says {val}; set it to "
                f'"auto" in the JSON or change the training setting.',
                param="deepspeed_config",
            )
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from the two above and the world size
    for key in ("bf16", "fp16"):
        ds.setdefault(key, {})
        if ds[key].get("enabled", "auto") == "auto":
            ds[key]["enabled"] = precision == key
    ds.setdefault("steps_per_print", 10**9)  # our own logging
    ds.setdefault("wall_clock_breakdown", False)
    return ds
