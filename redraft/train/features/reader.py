"""Reading cached features: ``features.json`` checked, shards as numpy memory maps, and
:class:`FeatureRecords`, the record source a run trains from with no target forward."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from redraft.errors import ArtifactError, ConfigError, FingerprintMismatchError
from redraft.train.batches import Batch
from redraft.train.config import TrainConfig
from redraft.train.features.layout import _NP, DATA_KEYS, FORMAT, META_FILE
from redraft.train.fingerprint import describe, record_mismatch


def read_features_meta(path, require_complete: bool = True) -> dict:
    """``features.json`` of a features directory, checked to exist (and be finished)."""
    root = Path(path)
    meta_file = root / META_FILE
    if not meta_file.is_file():
        what = "does not exist" if not root.exists() else f"holds no {META_FILE}"
        raise ConfigError(
            f"--features {root} {what}; cache features first: redraft-cache-features --target T "
            f"--data SPEC --output-dir {root}",
            param="features",
        )
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(
            f"{meta_file} is not valid JSON ({exc}); cache the features again "
            f"(redraft-cache-features ... --overwrite)."
        ) from exc
    if meta.get("format") != FORMAT:
        raise ArtifactError(
            f"{meta_file} has format {meta.get('format')!r}, not {FORMAT!r}; cache the features "
            f"again with this version of redraft."
        )
    if require_complete and not meta.get("complete"):
        done = sum((root / s["file"]).is_file() for s in meta.get("shards", []))
        raise ConfigError(
            f"--features {root} is unfinished ({done} of {len(meta.get('shards', []))} shards); run "
            f"redraft-cache-features again with the same arguments to finish it.",
            param="features",
        )
    return meta


def _shard_header(path: Path) -> tuple[dict, int]:
    """(tensor entries of the safetensors header, byte offset of the data). Raises ArtifactError
    naming the file when it is missing, truncated or not safetensors."""
    if not path.is_file():
        raise ArtifactError(
            f"Feature shard {path} is missing; run redraft-cache-features again with the same "
            f"arguments to write it (finished shards are kept)."
        )
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArtifactError(
            f"Feature shard {path} is truncated or not a safetensors file ({exc}); run "
            f"redraft-cache-features again with the same arguments to rewrite it."
        ) from exc
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    expect = 8 + n + max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if size != expect:
        raise ArtifactError(
            f"Feature shard {path} is truncated: {size} bytes, its header says {expect}; run "
            f"redraft-cache-features again with the same arguments to rewrite it (finished shards "
            f"are kept)."
        )
    return tensors, 8 + n


def open_shard(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a feature shard as read-only numpy memory maps (bfloat16 as uint16)."""
    tensors, start = _shard_header(path)
    out = {}
    for name, t in tensors.items():
        a, b = t["data_offsets"]
        dtype = _NP[t["dtype"]]
        shape = tuple(t["shape"])
        if b == a:
            out[name] = np.zeros(shape, dtype=dtype)
        else:
            out[name] = np.memmap(path, dtype=dtype, mode="r", offset=start + a, shape=shape)
    return out


def check_features_match(meta: dict, path, cfg: TrainConfig, record: dict) -> None:
    """The features must come from this run's target and data settings; errors name both sides."""
    saved = meta["target"]
    if record_mismatch(saved, record):
        raise FingerprintMismatchError(
            f"--features {path} were cached from target {describe(saved)}, but this run's target "
            f"{cfg.target!r} is {describe(record)}. Train with the features' target, or cache features for "
            f"this one (redraft-cache-features --target {cfg.target} ...)."
        )
    from redraft.train.config import FIELDS

    # a key a cache predates holds its default (self-distillation came later)
    # without self-distillation the distill_* settings decide nothing (KD-only ShareGPT records
    # stay valid when a recipe distils more first turns)
    keys = [k for k in DATA_KEYS if cfg.self_distill or not k.startswith("distill_")]
    saved_data = {k: meta["data"].get(k, FIELDS[k].default) for k in keys}
    diff = [k for k in keys if saved_data[k] != getattr(cfg, k)]
    if diff:
        both = ", ".join(
            f"{k} (features {saved_data[k]!r}, this run {getattr(cfg, k)!r})" for k in diff
        )
        raise ConfigError(
            f"--features {path} were cached for other training records: {both}. Pass the features' settings, "
            f"or cache features for these (redraft-cache-features with the same --recipe/--data/--max-length "
            f"...).",
            param="features",
        )


class FeatureRecords:
    """Record source over cached features (:mod:`redraft.train.batches` explains sources).

    Args:
        path: the features directory.
        cfg, record: when given, the features are checked against the run's data settings and
            its target record (:func:`check_features_match`).
        load_topk: read the top-k logits into batches (only the KD losses need them; default:
            ``cfg.loss != "ce"``).
    """

    def __init__(
        self,
        path,
        cfg: TrainConfig | None = None,
        record: dict | None = None,
        load_topk: bool | None = None,
    ):
        self.path = Path(path)
        self.meta = read_features_meta(self.path)
        if cfg is not None and record is not None:
            check_features_match(self.meta, self.path, cfg, record)
        self.load_topk = (cfg is None or cfg.loss != "ce") if load_topk is None else load_topk
        self.shards = [open_shard(self.path / s["file"]) for s in self.meta["shards"]]
        for s, sh in zip(self.meta["shards"], self.shards):
            n = s["records"][1] - s["records"][0]
            if len(sh["offsets"]) != n + 1 or int(sh["offsets"][-1]) != len(sh["input_ids"]):
                raise ArtifactError(
                    f"Feature shard {self.path / s['file']} holds {len(sh['offsets']) - 1} records, "
                    f"{META_FILE} says {n}; cache the features again (--overwrite)."
                )
        # per record: its shard, its first token inside the shard, its length (all [R])
        self.rec_shard = np.concatenate(
            [np.full(len(sh["offsets"]) - 1, i) for i, sh in enumerate(self.shards)]
        )
        self.rec_start = np.concatenate([np.asarray(sh["offsets"][:-1]) for sh in self.shards])
        self.lengths = np.concatenate(
            [np.diff(np.asarray(sh["offsets"])) for sh in self.shards]
        ).astype(np.int64)
        self.hidden_dtype = getattr(torch, self.meta["hidden_dtype"])
        # the layers a multi-layer head reads, concatenated per token (absent: the last only)
        self.hidden_layers = tuple(self.meta.get("hidden_layers", ()))
        self.hidden_size = int(self.meta["hidden_size"]) * max(1, len(self.hidden_layers))
        self.top_k = int(self.meta["top_k"])

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(self, idx, device) -> Batch:
        """Records ``idx`` as a right-padded :class:`~redraft.train.batches.Batch` with hidden
        states ``[B, T, F]`` (the cached dtype) and, with ``load_topk``, the top-k ``[B, T, k]``."""
        idx = np.asarray(idx, dtype=np.int64)
        B, T, k = len(idx), int(self.lengths[idx].max()), self.top_k
        ids = np.zeros((B, T), np.int64)
        mask = np.zeros((B, T), np.int64)
        hid = np.zeros((B, T, self.hidden_size), self.shards[0]["hidden"].dtype)
        tk_ids = np.zeros((B, T, k), np.int32) if self.load_topk else None
        tk_val = np.zeros((B, T, k), np.float32) if self.load_topk else None
        for b, r in enumerate(idx):  # B records, each one contiguous slice per array
            sh, s, n = self.shards[self.rec_shard[r]], int(self.rec_start[r]), int(self.lengths[r])
            ids[b, :n] = sh["input_ids"][s : s + n]
            mask[b, :n] = sh["loss_mask"][s : s + n]
            hid[b, :n] = sh["hidden"][s : s + n]
            if self.load_topk:
                tk_ids[b, :n] = sh["topk_ids"][s : s + n]
                tk_val[b, :n] = sh["topk_logits"][s : s + n]
        hidden = torch.from_numpy(hid)
        if self.hidden_dtype == torch.bfloat16:
            hidden = hidden.view(torch.bfloat16)
        return Batch(
            ids=torch.from_numpy(ids),
            mask=torch.from_numpy(mask),
            tokens=int(self.lengths[idx].sum()),
            loss_tokens=int(mask[:, 2:].sum()),
            hidden=hidden,
            topk_ids=torch.from_numpy(tk_ids) if self.load_topk else None,
            topk_logits=torch.from_numpy(tk_val) if self.load_topk else None,
            lengths=torch.from_numpy(self.lengths[idx].copy()),
        ).to(device)

    def token_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Flat ``(input_ids, loss_mask)`` of every record (for the draft vocabulary)."""
        return (
            np.concatenate([np.asarray(sh["input_ids"]) for sh in self.shards]),
            np.concatenate([np.asarray(sh["loss_mask"]) for sh in self.shards]),
        )
