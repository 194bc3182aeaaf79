"""Cached target features: run the frozen target once, train many epochs without it.

``redraft-cache-features --target T --data SPEC --output-dir DIR`` stores, for every token of
the training records (the same records ``redraft-train`` would draw: the train split of the
data spec, after ``max_length``/``pack``/``train_limit``), the target's last hidden state and its
top-k next-token logits; ``redraft-train --features DIR`` then trains with no target forward.
For a 7-8B target that forward is most of a training step's compute.

Layout of ``DIR``::

    features.json             format, the target's record (id, tokenizer and weights
                              fingerprints), the data settings, top_k, dtypes, the shard plan,
                              "complete": true once every shard is written
    shard-00000.safetensors   one contiguous range of records, tokens concatenated:
                                hidden       [N, F]  bfloat16 (or float32 / float16); F = H,
                                                     or k*H: the k layers "hidden_layers" of
                                                     features.json (--head-features multi)
                                topk_ids     [N, k]  int32    the target's top-k next tokens
                                topk_logits  [N, k]  float32  their logits
                                input_ids    [N]     int32
                                loss_mask    [N]     uint8
                                offsets      [R+1]   int64    record r is tokens offsets[r]:offsets[r+1]

Shards are plain safetensors files (any tool reads them); this module reads them as numpy
memory maps at the offsets the header gives, so a micro batch costs one slice copy per record
(no Python loop over tokens) and nothing is loaded up front. A shard is written whole to a
temporary file and renamed, so a killed run keeps every finished shard and continues with the
next one when started again with the same arguments. A shard whose size disagrees with its
header (a truncated copy) is named in the error, and rewritten by a resumed cache run.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch

from redraft.errors import ArtifactError, ConfigError, FingerprintMismatchError
from redraft.train.batches import Batch
from redraft.train.config import DEFAULT_TOP_K, HIDDEN_DTYPES, TrainConfig
from redraft.train.fingerprint import describe, record_mismatch, target_record
from redraft.utils import atomic_path, atomic_write_text

logger = logging.getLogger(__name__)

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


# ------------------------------------------------------------------------------ reading


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


# ------------------------------------------------------------------------------ writing


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
    from redraft.train.distributed import resolve_train_device
    from redraft.train.precision import resolve_precision, target_dtype

    cfg.validate()
    out = Path(out_dir)
    _check_args(out, top_k, hidden_dtype, batch_tokens, shard_mb)
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
    if dataset is None:
        dataset = _training_dataset(cfg, target, progress)
    from redraft.train.batches import TokenRecords, token_arrays

    records = TokenRecords(dataset)
    flat_ids, flat_mask = token_arrays(dataset)
    layers = head_layers(cfg, target)
    per_token = bytes_per_token(target.hidden_size * max(1, len(layers)), top_k, hidden_dtype)
    settings = {
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
    meta = _start_or_resume(
        out, settings, records.lengths, int(shard_mb * 2**20) // per_token, overwrite
    )
    todo = [
        i for i, s in enumerate(meta["shards"]) if not _shard_ok(out / s["file"])
    ]  # missing or damaged
    if meta.get("complete") and not todo:
        logger.info("features in %s are complete", out)
        return meta

    bar = _bar(sum(meta["shards"][i]["tokens"] for i in todo), progress)
    first_token = np.concatenate(
        [[0], np.cumsum(records.lengths)]
    )  # [R+1] of the flat token arrays
    for i in todo:
        start, end = meta["shards"][i]["records"]
        a, b = int(first_token[start]), int(first_token[end])
        tensors = {
            **_shard_features(
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
            ),
            "input_ids": torch.from_numpy(flat_ids[a:b].astype(np.int32)),
            "loss_mask": torch.from_numpy(flat_mask[a:b].astype(np.uint8)),
            "offsets": torch.from_numpy(first_token[start : end + 1] - a),
        }
        _write_shard(
            out / meta["shards"][i]["file"],
            tensors,
            {"format": FORMAT, "records": f"{start}:{end}"},
        )
    bar.close()
    meta["complete"] = True
    atomic_write_text(out / META_FILE, json.dumps(meta, indent=2))
    return meta


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


__all__ = [
    "cache_features",
    "FeatureRecords",
    "read_features_meta",
    "open_shard",
    "check_features_match",
    "shard_plan",
    "bytes_per_token",
    "disk_bytes",
    "DEFAULT_TOP_K",
    "HIDDEN_DTYPES",
]
