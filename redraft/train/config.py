"""Training configuration: one dataclass, recipes in ``train/recipes/*.yaml``, CLI overrides.

A recipe is a flat YAML mapping of :class:`TrainConfig` keys. The resolved config is the
dataclass defaults, then the recipe, then command-line overrides (``--lr 3e-4`` or
``--set lr=3e-4``). A key that does not exist is a :class:`~redraft.errors.ConfigError` naming it.

The dataclass itself, its fields and their checks, is :mod:`redraft.train.schema`; this module
resolves recipes and overrides into one, and says which settings a resumed run may change.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from redraft.errors import ConfigError
from redraft.resources import config_dir
from redraft.settings import Range, read_yaml_mapping
from redraft.train.schema import TRACKER_PACKAGES, TrainConfig, parse_report_to

__all__ = [
    "Range",
    "TrainConfig",
    "load_recipe",
    "make_config",
    "parse_set",
    "coerce",
    # defined with TrainConfig (redraft.train.schema), importable from here
    "TRACKER_PACKAGES",
    "parse_report_to",
]

# train/ at the repository root holds the DeepSpeed configs and recipes (no Python); it ships
# with the package (redraft.resources).
TRAIN_DIR = config_dir("train")
RECIPES_DIR = TRAIN_DIR / "recipes"


# redraft-cache-features: next-token logits kept per token, and the dtypes hidden states may be stored in
DEFAULT_TOP_K = 8
HIDDEN_DTYPES = ("bfloat16", "float16", "float32")

FIELDS = TrainConfig.schema()
# Every numeric setting's valid range (a view of the fields' metadata; TrainConfig.validate checks them)
RANGES = {k: f.metadata["range"] for k, f in FIELDS.items() if f.metadata["range"] is not None}

# Keys that may change when a run is resumed; every other key must equal the saved run's.
# "target" may be spelled differently (a moved directory, a hub id instead of a local copy): the
# run's target_record (tokenizer and weights fingerprints) is what must match.
# "features" may move likewise: features are checked against the run's data and target.
RESUMABLE_CHANGES = {
    "max_time_minutes",
    "eval_every",
    "save_every",
    "keep_checkpoints",
    "log_every",
    "report_to",
    "output_dir",
    "run_name",
    "push_to_hub",
    "hub_private",
    "hub_revision",
    "eval_limit",
    "eval_batch_size",
    "num_proc",
    "data_cache_dir",
    "device",
    "target",
    "threads",
    "features",
    "loss_impl",
    "distill_dir",
    "distill_batch_size",
}

# Keys a run_config.yaml holds that are records, not settings: a recipe may contain them (so a
# run's run_config.yaml can be reused as a recipe) and they are ignored.
RECORD_KEYS = {"target_record"}

# Old spellings still accepted in recipes and --set: key -> function(value) -> (key, value)
ALIASES = {"tensorboard": lambda v: ("report_to", "tensorboard" if _truthy(v) else "none")}


def _truthy(v) -> bool:
    return v is True or str(v).strip().lower() in ("true", "1", "yes", "on")


def _resolve_alias(key: str, value):
    return ALIASES[key](value) if key in ALIASES else (key, value)


def recipe_names() -> list[str]:
    """Names of the shipped recipes (train/recipes/*.yaml), sorted."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def coerce(key: str, value: Any, where: str = "the command line") -> Any:
    """Convert ``value`` (YAML-parsed or a CLI string) to the type of field ``key`` (an old
    spelling in ALIASES is read as its new key first)."""
    key, value = _resolve_alias(key, value)
    return TrainConfig.coerce(key, value, where)


def find_recipe(name_or_path: str) -> Path:
    """``default`` -> ``train/recipes/default.yaml``; a path is used as is."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    for cand in (RECIPES_DIR / f"{name_or_path}.yaml", RECIPES_DIR / name_or_path):
        if cand.is_file():
            return cand
    raise ConfigError(
        f"Recipe {name_or_path!r} not found (no such file, and not one of {recipe_names()} in "
        f"{RECIPES_DIR}).",
        param="recipe",
    )


def load_recipe(name_or_path: str) -> dict:
    """A recipe file as a dict of validated, typed keys."""
    path = find_recipe(name_or_path)
    raw = read_yaml_mapping(path, what="Recipe")
    out = {}
    for k, v in raw.items():
        if k in RECORD_KEYS:
            continue
        k, v = _resolve_alias(k, v)
        out[k] = coerce(k, v, where=str(path))
    return out


def make_config(recipe: str | None = None, overrides: dict | None = None) -> TrainConfig:
    """Defaults <- recipe <- overrides (values may be CLI strings). An override of
    ``micro_batch_size`` or ``grad_accum`` without one of ``gpu_micro_batch_size`` clears the
    recipe's ``gpu_micro_batch_size``: the batch shape typed is the one that runs."""
    values = load_recipe(recipe) if recipe else {}
    given = set()
    for k, v in (overrides or {}).items():
        k, v = _resolve_alias(k, v)
        values[k] = coerce(k, v)
        given.add(k)
    if given & {"micro_batch_size", "grad_accum"} and "gpu_micro_batch_size" not in given:
        values.pop("gpu_micro_batch_size", None)
    return TrainConfig(**values).validate()


def for_device(cfg: TrainConfig, device) -> TrainConfig:
    """``cfg`` with ``gpu_micro_batch_size`` applied when ``device`` is CUDA: the same batch per
    process as ``gpu_micro_batch_size`` x (``micro_batch_size`` x ``grad_accum`` / it). Else
    ``cfg`` itself."""
    g = cfg.gpu_micro_batch_size
    if not g or not str(device).startswith("cuda") or g == cfg.micro_batch_size:
        return cfg
    per_process = cfg.micro_batch_size * cfg.grad_accum
    return dataclasses.replace(cfg, micro_batch_size=g, grad_accum=per_process // g)


def parse_set(items: list[str]) -> dict:
    """``["lr=3e-4", "rnn=false"]`` -> ``{"lr": "3e-4", "rnn": "false"}``."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE.")
        k, v = item.split("=", 1)
        k = k.strip().replace("-", "_")
        if k not in FIELDS and k not in ALIASES:
            raise TrainConfig.unknown(k, "--set")
        out[k] = v
    return out


def config_diff(saved: dict, current: TrainConfig) -> list[str]:
    """Keys whose value differs from a saved run's and that may not change on resume."""
    cur = current.to_dict()
    return sorted(
        k for k in cur if k not in RESUMABLE_CHANGES and k in saved and saved[k] != cur[k]
    )
