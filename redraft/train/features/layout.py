"""The features directory's format: its names, the bytes a token takes, the shard plan, and the
data settings that decide which records a cache holds (the layout is in the package doc)."""

from __future__ import annotations

import numpy as np
import torch

from redraft.train.config import TrainConfig

FORMAT = "redraft-features/1"
META_FILE = "features.json"
# the data settings that decide which records (and tokens) a run trains on
DATA_KEYS = (
    "data",
    "max_length",
    "pack",
    "heldout_fraction",
    "train_limit",
    "self_distill",
    "distill_limit",
    "distill_max_new_tokens",
    "distill_max_turns",
    "distill_max_prompt_tokens",
)
# safetensors dtype -> numpy dtype of the memory map (bfloat16 is read as uint16, viewed by torch)
_NP = {
    "BF16": np.uint16,
    "F16": np.float16,
    "F32": np.float32,
    "I32": np.int32,
    "U8": np.uint8,
    "I64": np.int64,
}


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def bytes_per_token(hidden_size: int, top_k: int, hidden_dtype: str) -> int:
    """Disk bytes one token takes (hidden + top-k ids and logits + id + mask)."""
    return (
        hidden_size * torch.empty((), dtype=getattr(torch, hidden_dtype)).element_size()
        + top_k * 8
        + 4
        + 1
    )


def shard_plan(lengths: np.ndarray, tokens_per_shard: int) -> list[tuple[int, int]]:
    """Contiguous record ranges ``[(start, end), ...]`` of about ``tokens_per_shard`` tokens each:
    a record belongs to the shard its first token falls in (vectorised, no loop over records)."""
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # first token of each record
    shard = first // max(1, tokens_per_shard)
    cuts = np.flatnonzero(np.diff(shard)) + 1
    bounds = [0, *cuts.tolist(), len(lengths)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def data_settings(cfg: TrainConfig) -> dict:
    return {k: getattr(cfg, k) for k in DATA_KEYS}
