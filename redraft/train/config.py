"""Training configuration: one dataclass, recipes in ``train/recipes/*.yaml``, CLI overrides.

A recipe is a flat YAML mapping of :class:`TrainConfig` keys. The resolved config is the
dataclass defaults, then the recipe, then command-line overrides (``--lr 3e-4`` or
``--set lr=3e-4``). A key that does not exist is a :class:`~redraft.errors.ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from redraft.errors import ConfigError
from redraft.resources import config_dir

# train/ at the repository root holds the DeepSpeed configs and recipes (no Python); it ships
# with the package (redraft.resources).
TRAIN_DIR = config_dir("train")
RECIPES_DIR = TRAIN_DIR / "recipes"


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class TrainConfig:
    """Every setting of a ``redraft-train`` run (each is a recipe key and a ``--flag``)."""

    # ---- target and data
    target: str = _f("default", "Target model: 'default', a .gguf file, a local HF/PEFT directory or a hub id.")
    data: str = _f("default-chat", "Training data source spec (redraft.data grammar, e.g. 'default-chat', "
                   "'sharegpt:FILE.jsonl', a mixture).")
    eval_data: str | None = _f(None, "Held-out data spec; default: the held-out split of --data.")
    max_length: int = _f(2048, "Truncate each tokenized record to this many tokens.")
    pack: bool = _f(False, "Pack records into max_length sequences (redraft.data).")
    heldout_fraction: float = _f(0.02, "Fraction of records (by id hash) held out for evaluation.")
    train_limit: int | None = _f(None, "Use at most this many training records.")
    eval_limit: int | None = _f(200, "Evaluate on at most this many held-out records.")
    data_cache_dir: str | None = _f(None, "Token dataset cache directory (default under the redraft cache).")
    num_proc: int | None = _f(None, "Processes for tokenization (datasets.map num_proc).")

    # ---- the head
    num_steps: int = _f(5, "Training horizon n: draft tokens predicted from each hidden state.")
    num_layers: int = _f(2, "ResNet blocks in the head.")
    rnn: bool = _f(True, "Use the recurrence s_i = f(U s_{i-1} + W e_i + b); false = paper's ablation.")
    activation: str = _f("silu", "Activation f of the recurrence and the ResNet blocks.")
    draft_vocab_size: int | None = _f(None, "Reduced draft vocabulary: the N most frequent target tokens "
                                      "(assistant tokens of the training data); none = full vocabulary.")
    init_from: str | None = _f(None, "Start from the weights of this drafter artifact (fine-tuning).")
    init_head: str = _f("random", "'random' (paper) or 'target': the output layer starts as the target's LM head "
                        "on x (zeros on s) and the ResNet blocks as identity (Medusa-style warm start).")

    # ---- objective
    loss: str = _f("ce", "'ce' (cross-entropy on the data), 'kd' (KL to the target's distribution) or 'ce+kd'.")
    kd_weight: float = _f(1.0, "Weight of the KL term in 'ce+kd'.")

    # ---- optimisation (paper / Apple recipe defaults)
    epochs: float = _f(2, "Passes over the training data (fractions allowed).")
    max_steps: int | None = _f(None, "Stop after this many optimizer steps (overrides epochs for the schedule).")
    max_time_minutes: float | None = _f(None, "Stop (checkpoint, evaluate, save) after this much training time.")
    micro_batch_size: int = _f(1, "Sequences per micro batch per process.")
    grad_accum: int = _f(8, "Micro batches accumulated per optimizer step (per process).")
    lr: float = _f(1e-3, "Peak learning rate (AdamW).")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_betas: tuple = _f((0.9, 0.999), "AdamW betas.")
    warmup_ratio: float = _f(0.1, "Linear warm-up as a fraction of the schedule.")
    min_lr_ratio: float = _f(0.0, "Final learning rate of the cosine decay, as a fraction of lr.")
    schedule_by_time: bool = _f(False, "With max_time_minutes: run warm-up and cosine over the time budget "
                                "instead of the step count (bounded CPU demos; resume is then not bit-exact).")
    grad_clip: float = _f(1.0, "Gradient-norm clipping (0 = off).")
    group_by_length: bool = _f(True, "Batch records of similar length together (less padding).")

    # ---- precision and DeepSpeed
    precision: str = _f("auto", "'bf16', 'fp16', 'fp32' (DeepSpeed weights/optimizer precision) or "
                        "'amp-bf16' (fp32 weights, bf16 autocast compute). auto: bf16 on GPU with ZeRO>=1, else amp-bf16.")
    zero_stage: int = _f(0, "ZeRO stage 0-3 (picks train/ds_zero<stage>.json).")
    deepspeed_config: str | None = _f(None, "A DeepSpeed JSON config; 'auto' values are filled from this config.")
    device: str = _f("auto", "'auto', 'cpu' or 'cuda'.")
    threads: int | None = _f(None, "CPU threads per process (default: the cores split between local ranks). "
                             "On a CPU shared with other jobs 1 thread can be several times faster.")

    # ---- evaluation, logging, checkpoints
    eval_every: int = _f(500, "Evaluate on the held-out set every N optimizer steps (0 = only at the end).")
    eval_batch_size: int = _f(4, "Sequences per evaluation batch.")
    save_every: int = _f(500, "Checkpoint every N optimizer steps (0 = only at the end / on a signal).")
    keep_checkpoints: int = _f(2, "Keep the newest N checkpoints in training_state/.")
    log_every: int = _f(10, "TensorBoard / progress-bar logging interval (optimizer steps).")
    tensorboard: bool = _f(True, "Write TensorBoard events under <output_dir>/tensorboard.")
    output_dir: str | None = _f(None, "Run directory (default checkpoints/<run_name>).")
    run_name: str | None = _f(None, "Run name (default redrafter-<target name>).")
    seed: int = _f(0, "Seed of the head's init and of the data order.")

    # ---- publishing
    push_to_hub: str | None = _f(None, "Push the finished artifact to this hub repo id.")
    hub_private: bool = _f(False, "Create the hub repo as private.")
    hub_revision: str | None = _f(None, "Branch / revision to push to.")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["adam_betas"] = list(self.adam_betas)
        return d

    def resolved_output_dir(self) -> Path:
        if self.output_dir:
            return Path(self.output_dir).expanduser()
        return Path("checkpoints") / self.resolved_run_name()  # relative to the working directory

    def resolved_run_name(self) -> str:
        if self.run_name:
            return self.run_name
        name = self.target.rstrip("/").split("/")[-1].split("@")[0].removesuffix(".gguf")
        return f"redrafter-{name or 'target'}"

    def validate(self) -> "TrainConfig":
        def bad(key, why):
            raise ConfigError(f"Invalid setting {key}={getattr(self, key)!r}: {why}")

        if self.loss not in ("ce", "kd", "ce+kd"):
            bad("loss", "use 'ce', 'kd' or 'ce+kd'.")
        if self.init_head not in ("random", "target"):
            bad("init_head", "use 'random' or 'target'.")
        if self.precision not in ("auto", "bf16", "fp16", "fp32", "amp-bf16"):
            bad("precision", "use auto, bf16, fp16, fp32 or amp-bf16.")
        if self.zero_stage not in (0, 1, 2, 3):
            bad("zero_stage", "use 0, 1, 2 or 3.")
        if self.device not in ("auto", "cpu", "cuda"):
            bad("device", "use auto, cpu or cuda.")
        for key in ("num_steps", "micro_batch_size", "grad_accum", "max_length", "eval_batch_size"):
            if int(getattr(self, key)) < 1:
                bad(key, "must be >= 1.")
        if self.num_layers < 0:
            bad("num_layers", "must be >= 0.")
        if not 0 <= self.warmup_ratio < 1:
            bad("warmup_ratio", "must be in [0, 1).")
        if self.epochs <= 0 and not self.max_steps:
            bad("epochs", "must be > 0 (or set max_steps).")
        if self.schedule_by_time and not self.max_time_minutes:
            bad("schedule_by_time", "needs max_time_minutes.")
        if len(self.adam_betas) != 2:
            bad("adam_betas", "needs two numbers, e.g. [0.9, 0.999].")
        return self


FIELDS = {f.name: f for f in fields(TrainConfig)}

# Keys that may change when a run is resumed; every other key must equal the saved run's.
RESUMABLE_CHANGES = {
    "max_time_minutes", "eval_every", "save_every", "keep_checkpoints", "log_every", "tensorboard",
    "output_dir", "run_name", "push_to_hub", "hub_private", "hub_revision", "eval_limit",
    "eval_batch_size", "num_proc", "data_cache_dir", "device", "target", "threads",
}


def _unknown(key: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, FIELDS, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"Unknown training setting {key!r} in {where}.{hint} "
                       f"Known settings: {', '.join(sorted(FIELDS))}.")


def coerce(key: str, value: Any, where: str = "the command line") -> Any:
    """Convert ``value`` (YAML-parsed or a CLI string) to the type of field ``key``."""
    if key not in FIELDS:
        raise _unknown(key, where)
    default = FIELDS[key].default
    if isinstance(value, str) and not isinstance(default, str):
        value = yaml.safe_load(value) if value.strip() else None  # '3e-4' -> float, 'true' -> bool
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
        return None
    typ = FIELDS[key].type
    try:
        if key == "adam_betas":
            return tuple(float(v) for v in value)
        if "bool" in typ:
            if not isinstance(value, bool):
                raise ValueError("expected true or false")
            return value
        if typ.startswith("int"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("expected an integer")
            return int(value)
        if typ.startswith("float"):
            return float(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"Setting {key}={value!r} in {where} has the wrong type ({typ}): {exc}.") from exc


def find_recipe(name_or_path: str) -> Path:
    """``default`` -> ``train/recipes/default.yaml``; a path is used as is."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    for cand in (RECIPES_DIR / f"{name_or_path}.yaml", RECIPES_DIR / name_or_path):
        if cand.is_file():
            return cand
    have = sorted(x.stem for x in RECIPES_DIR.glob("*.yaml"))
    raise ConfigError(f"Recipe {name_or_path!r} not found (no such file, and not one of {have} in {RECIPES_DIR}).")


def load_recipe(name_or_path: str) -> dict:
    """A recipe file as a dict of validated, typed keys."""
    path = find_recipe(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"Recipe {path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"Recipe {path} must be a mapping of settings, got {type(raw).__name__}.")
    return {k: coerce(k, v, where=str(path)) for k, v in raw.items()}


def make_config(recipe: str | None = None, overrides: dict | None = None) -> TrainConfig:
    """Defaults <- recipe <- overrides (values may be CLI strings)."""
    values = load_recipe(recipe) if recipe else {}
    for k, v in (overrides or {}).items():
        values[k] = coerce(k, v)
    return TrainConfig(**values).validate()


def parse_set(items: list[str]) -> dict:
    """``["lr=3e-4", "rnn=false"]`` -> ``{"lr": "3e-4", "rnn": "false"}``."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE.")
        k, v = item.split("=", 1)
        k = k.strip().replace("-", "_")
        if k not in FIELDS:
            raise _unknown(k, "--set")
        out[k] = v
    return out


def config_diff(saved: dict, current: TrainConfig) -> list[str]:
    """Keys whose value differs from a saved run's and that may not change on resume."""
    cur = current.to_dict()
    return sorted(k for k in cur if k not in RESUMABLE_CHANGES and k in saved and saved[k] != cur[k])
