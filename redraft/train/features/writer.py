"""Writing cached features: the frozen target run once over the training records, shard by
shard, each written whole; a killed run continues with the shards it lacks."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch

from redraft.errors import ArtifactError, ConfigError
from redraft.train.config import DEFAULT_TOP_K, HIDDEN_DTYPES, TrainConfig
from redraft.train.features.layout import (
    FORMAT,
    META_FILE,
    bytes_per_token,
    data_settings,
    shard_name,
    shard_plan,
)
from redraft.train.features.reader import _shard_header, read_features_meta
from redraft.train.fingerprint import target_record
from redraft.utils import atomic_path, atomic_write_text

logger = logging.getLogger("redraft.train.features")  # the package's logger


def cache_features(
    cfg: TrainConfig,
    out_dir,
    *,
    top_k: int = DEFAULT_TOP_K,
    hidden_dtype: str = "bfloat16",
    batch_tokens: int = 8192,
    shard_mb: float = 512,
    overwrite: bool = False,
    target=None,
    dataset=None,
    progress: bool = True,
) -> dict:
    """Run the frozen target over the training records of ``cfg`` and cache its features.

    Args:
        cfg: the run's settings: ``target``, the data settings (:data:`DATA_KEYS`),
            ``num_proc``/``data_cache_dir``, ``device``, ``precision``, ``threads``.
        out_dir: the features directory (created; a finished or partial cache with the same
            settings is kept and completed; other settings need ``overwrite``).
        top_k: next-token logits kept per token (for the KD losses); >= 1.
        hidden_dtype: ``bfloat16`` (default), ``float16`` or ``float32``.
        batch_tokens: padded tokens per target forward.
        shard_mb: about this many MiB per shard (a shard is built in memory, then written).
        target, dataset: an already loaded Target / training token dataset (tests, benchmarks).

    Returns:
        The ``features.json`` contents.
    """
    cfg.validate()
    out = Path(out_dir)
    _check_args(out, top_k, hidden_dtype, batch_tokens, shard_mb)
    device, precision, target = _device_and_target(cfg, target, top_k)
    if dataset is None:
        dataset = _training_dataset(cfg, target, progress)
    from redraft.train.batches import TokenRecords, token_arrays

    records = TokenRecords(dataset)
    flat_ids, flat_mask = token_arrays(dataset)
    layers = head_layers(cfg, target)
    per_token = bytes_per_token(target.hidden_size * max(1, len(layers)), top_k, hidden_dtype)
    settings = _settings(
        cfg, target, records, flat_ids, layers, per_token, precision, top_k, hidden_dtype
    )
    meta = _start_or_resume(
        out, settings, records.lengths, int(shard_mb * 2**20) // per_token, overwrite
    )
    # the shards missing or damaged
    todo = [i for i, s in enumerate(meta["shards"]) if not _shard_ok(out / s["file"])]
    if meta.get("complete") and not todo:
        logger.info("features in %s are complete", out)
        return meta

    bar = _bar(sum(meta["shards"][i]["tokens"] for i in todo), progress)
    first_token = np.concatenate([[0], np.cumsum(records.lengths)])  # [R+1] in the flat arrays
    for i in todo:
        start, end = meta["shards"][i]["records"]
        features = _shard_features(
            target,
            records,
            (start, end),
            precision,
            top_k,
            getattr(torch, hidden_dtype),
            batch_tokens,
            device,
            bar,
            layers,
        )
        _write_shard(
            out / meta["shards"][i]["file"],
            {**features, **_token_tensors(flat_ids, flat_mask, first_token, start, end)},
            {"format": FORMAT, "records": f"{start}:{end}"},
        )
    bar.close()
    meta["complete"] = True
    atomic_write_text(out / META_FILE, json.dumps(meta, indent=2))
    return meta


def _device_and_target(cfg: TrainConfig, target, top_k: int):
    """The device, the precision and the target (loaded unless given), with ``top_k`` checked
    against its vocabulary."""
    from redraft.train.distributed import resolve_train_device
    from redraft.train.precision import resolve_precision, target_dtype

    device = resolve_train_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    precision = resolve_precision(cfg, device)
    if target is None:
        from redraft.models import load_target

        target = load_target(cfg.target, dtype=target_dtype(precision, device), device=device)
    if top_k > target.vocab_size:
        raise ConfigError(
            f"--top-k {top_k} is out of range: the target has {target.vocab_size} tokens.",
            param="top_k",
        )
    return device, precision, target


def _settings(
    cfg: TrainConfig,
    target,
    records,
    flat_ids,
    layers,
    per_token: int,
    precision: str,
    top_k: int,
    hidden_dtype: str,
) -> dict:
    """What a cache is made with (a resume needs the same): features.json's settings."""
    return {
        "format": FORMAT,
        "target": target_record(target),
        "data": data_settings(cfg),
        "precision": precision,
        "top_k": top_k,
        "hidden_dtype": hidden_dtype,
        "hidden_size": target.hidden_size,
        "records": len(records),
        "tokens": int(records.lengths.sum()),
        "tokens_sha256": "sha256:"
        + hashlib.sha256(flat_ids.astype(np.int32).tobytes()).hexdigest()[:16],
        "bytes_per_token": per_token,
        # only for a multi-layer head, so the settings of a last-state cache are what they were
        **({"hidden_layers": list(layers)} if layers else {}),
    }


def _token_tensors(flat_ids, flat_mask, first_token, start: int, end: int) -> dict:
    """Records ``start:end``'s tokens, loss mask and offsets (from 0) as a shard's tensors."""
    a, b = int(first_token[start]), int(first_token[end])
    return {
        "input_ids": torch.from_numpy(flat_ids[a:b].astype(np.int32)),
        "loss_mask": torch.from_numpy(flat_mask[a:b].astype(np.uint8)),
        "offsets": torch.from_numpy(first_token[start : end + 1] - a),
    }


def _bar(total: int, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=total, unit="tok", desc="cache features", disable=not progress, dynamic_ncols=True
    )


def _check_args(out: Path, top_k, hidden_dtype: str, batch_tokens, shard_mb) -> None:
    """The writer's own arguments, each error naming its flag."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir {out} is a file; pass a directory.", param="output_dir")
    if hidden_dtype not in HIDDEN_DTYPES:
        raise ConfigError(
            f"--hidden-dtype {hidden_dtype!r}: use one of {', '.join(HIDDEN_DTYPES)}.",
            param="hidden_dtype",
        )
    for name, v, lo in (("top_k", top_k, 1), ("batch_tokens", batch_tokens, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(
                f"--{name.replace('_', '-')} {v!r} is out of range: must be an integer >= {lo}.",
                param=name,
            )
    if not shard_mb > 0:
        raise ConfigError(
            f"--shard-mb {shard_mb!r} is out of range: must be > 0.", param="shard_mb"
        )


def _training_dataset(cfg: TrainConfig, target, progress: bool):
    """The run's training token dataset (with ``self_distill``: of the target's own replies, made
    once and cached)."""
    import types

    from redraft.data import build_token_dataset
    from redraft.train.distilled import distilled_data

    solo = types.SimpleNamespace(
        is_main=True, say=lambda m: print(m, flush=True), barrier=lambda: None
    )
    data = distilled_data(cfg, target, target_record(target), solo).data
    return build_token_dataset(
        data,
        target.tokenizer,
        split="train",
        limit=cfg.train_limit,
        max_length=cfg.max_length,
        pack=cfg.pack,
        heldout_fraction=cfg.heldout_fraction,
        num_proc=cfg.num_proc,
        cache_dir=cfg.data_cache_dir,
        progress=progress,
    )


def head_layers(cfg: TrainConfig, target) -> tuple[int, ...]:
    """The hidden-state layers the run's head reads (``()``: the last only), checked."""
    if cfg.head_features == "last":
        return ()
    from redraft.models.redrafter_config import ReDrafterConfig

    return ReDrafterConfig.for_target(
        target, features=cfg.head_features, feature_layers=cfg.feature_layers
    ).hidden_layers


def _shard_features(
    target,
    records,
    span: tuple[int, int],
    precision: str,
    top_k: int,
    hidden_dtype: torch.dtype,
    batch_tokens: int,
    device,
    bar,
    layers: tuple[int, ...] = (),
) -> dict[str, torch.Tensor]:
    """The target's features of records ``span = (start, end)``, tokens concatenated in record
    order: ``hidden`` [N, F] (F = H, or k*H for ``layers``), ``topk_ids`` [N, k] int32,
    ``topk_logits`` [N, k] float32 (CPU)."""
    from redraft.train.step import last_hidden, target_hidden, target_topk

    start, end = span
    lengths = records.lengths[start:end]
    offsets = np.concatenate([[0], np.cumsum(lengths)])  # each record's first token in the shard
    n = int(offsets[-1])
    hidden = torch.empty(n, target.hidden_size * max(1, len(layers)), dtype=hidden_dtype)
    topk_ids = torch.empty(n, top_k, dtype=torch.int32)
    topk_logits = torch.empty(n, top_k, dtype=torch.float32)
    order = start + np.argsort(-lengths, kind="stable")  # similar lengths together: little padding
    for group in _length_groups(order, records.lengths, batch_tokens):
        batch = records.batch(group, device)
        h = target_hidden(target, batch.ids, precision, layers)  # [B, T, F]
        t_ids, t_val = target_topk(target, last_hidden(target, h), precision, top_k)  # [B, T, k]
        h, t_ids, t_val = h.to(hidden_dtype).cpu(), t_ids.cpu(), t_val.cpu()
        for row, r in enumerate(group):  # B records: one slice copy each
            a, ln = int(offsets[r - start]), int(records.lengths[r])
            hidden[a : a + ln] = h[row, :ln]
            topk_ids[a : a + ln] = t_ids[row, :ln]
            topk_logits[a : a + ln] = t_val[row, :ln]
        bar.update(int(records.lengths[group].sum()))
    return {"hidden": hidden, "topk_ids": topk_ids, "topk_logits": topk_logits}


def _length_groups(order: np.ndarray, lengths: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Split ``order`` (longest first) into groups whose padded size ``B x max len`` stays within
    ``batch_tokens`` (one record at least)."""
    groups, i = [], 0
    while i < len(order):
        longest = int(lengths[order[i]])
        b = max(1, batch_tokens // max(1, longest))
        groups.append(order[i : i + b])
        i += b
    return groups


def _write_shard(path: Path, tensors: dict, metadata: dict) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def _shard_ok(path: Path) -> bool:
    """A finished shard (written whole by a rename); a damaged one is reported and rewritten."""
    if not path.is_file():
        return False
    try:
        _shard_header(path)
        return True
    except ArtifactError as exc:
        logger.warning("%s; rewriting it", exc)
        return False


def _start_or_resume(
    out: Path, settings: dict, lengths: np.ndarray, tokens_per_shard: int, overwrite: bool
) -> dict:
    """The features.json to fill: a new plan, or the existing one when its settings are these."""
    meta_file = out / META_FILE
    if meta_file.is_file() and not overwrite:
        old = read_features_meta(out, require_complete=False)
        diff = [k for k in settings if old.get(k) != settings[k]]
        if diff:
            both = "; ".join(f"{k}: cached {old.get(k)!r}, now {settings[k]!r}" for k in diff)
            raise ConfigError(
                f"{out} already holds features cached with other settings ({both}). Pass the same "
                f"arguments to finish them, --overwrite to replace them, or another --output-dir.",
                param="output_dir",
            )
        return old
    if overwrite and out.is_dir():
        for p in [meta_file, *out.glob("shard-*.safetensors"), *out.glob(".shard-*.tmp")]:
            p.unlink(missing_ok=True)
    elif out.is_dir() and any(out.glob("shard-*.safetensors")):
        raise ConfigError(
            f"{out} holds feature shards without {META_FILE}; pass --overwrite to replace them or "
            f"choose another --output-dir.",
            param="output_dir",
        )
    out.mkdir(parents=True, exist_ok=True)
    plan = shard_plan(lengths, tokens_per_shard)
    meta = {
        **settings,
        "complete": False,
        "shards": [
            {"file": shard_name(i), "records": [a, b], "tokens": int(lengths[a:b].sum())}
            for i, (a, b) in enumerate(plan)
        ],
    }
    atomic_write_text(meta_file, json.dumps(meta, indent=2))
    return meta


def disk_bytes(path) -> int:
    """Bytes the shards of a features directory take on disk."""
    return sum(p.stat().st_size for p in Path(path).glob("shard-*.safetensors"))
