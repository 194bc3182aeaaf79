"""Run directory, checkpoints (DeepSpeed) and the drafter artifact.

Layout of ``<output_dir>``::

    config.json, model.safetensors, README.md   the drafter artifact (load_drafter reads these)
    metrics.json                                train / held-out figures of the last run
    run_config.yaml                             the resolved TrainConfig + the target's record
    training_state/step-<N>/                    DeepSpeed checkpoints (+ our client state, RNG)
    tensorboard/                                event files
    .artifact.tmp/                              only while a new artifact is being swapped in

The artifact is written whole into ``.artifact.tmp/`` and then swapped in by
:func:`swap_in_artifact` so that the directory never holds new weights next to old metrics or
an old card: ``config.json`` (what makes the directory a drafter artifact) goes first and comes
back last. A run killed during the swap is completed by :func:`recover_artifact` at the next
start. ``training_state/`` and ``tensorboard/`` are never moved.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import yaml

from redraft.errors import ConfigError
from redraft.utils import atomic_write_text

logger = logging.getLogger(__name__)

STATE_DIR = "training_state"
STAGE_DIR = ".artifact.tmp"
STAGE_DONE = ".complete"  # written into STAGE_DIR once every file of the new artifact is there
RUN_CONFIG = "run_config.yaml"
METRICS = "metrics.json"
CARD = "README.md"
RUN_FILES = (
    RUN_CONFIG,
    STATE_DIR,
    "model.safetensors",
    "config.json",
    CARD,
    METRICS,
    "tensorboard",
    STAGE_DIR,
)


def check_output_dir(out: Path) -> None:
    """Refuse, before any work, an output directory that cannot be one: an existing file, or
    a path under a file."""
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == out else f"is under {p}, which is a file"
                raise ConfigError(
                    f"--output-dir {out} {what}; pass a directory (it is created if missing).",
                    param="output_dir",
                )
            if not os.access(p, os.W_OK):
                raise ConfigError(
                    f"--output-dir {out}: {p} is not writable; choose another --output-dir.",
                    param="output_dir",
                )
            return


def prepare_output_dir(out: Path, resume: bool, overwrite: bool, rank: int) -> bool:
    """Check the run directory; returns True when it holds a run to resume.

    An existing run (any of :data:`RUN_FILES`) needs ``resume`` or ``overwrite``; ``overwrite``
    deletes only those entries (never anything else the directory holds). On resume an
    interrupted artifact swap is completed first (:func:`recover_artifact`).
    """
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found and not (resume or overwrite):
        raise ConfigError(
            f"Output directory {out} already holds a run ({', '.join(found)}). Pass --resume to "
            f"continue it, --overwrite to replace it, or choose another --output-dir.",
            param="output_dir",
        )
    if found and overwrite and not resume and rank == 0:
        for name in found:
            p = out / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if resume:
            recover_artifact(out)
    return bool(found) and resume


def latest_tag(out: Path) -> str | None:
    tags = checkpoint_tags(out)
    return tags[-1] if tags else None


def checkpoint_tags(out: Path) -> list[str]:
    """Complete checkpoints (those with our client file), oldest first."""
    d = out / STATE_DIR
    if not d.is_dir():
        return []
    tags = [
        p.name
        for p in d.iterdir()
        if p.is_dir() and re.fullmatch(r"step-\d+", p.name) and (p / "redraft_state.json").is_file()
    ]
    return sorted(tags, key=lambda t: int(t.split("-")[1]))


def rng_state() -> dict:
    st = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(engine, out: Path, state: dict, rank: int, keep: int, barrier) -> Path:
    """DeepSpeed checkpoint (weights, optimizer, scheduler) + data position + per-rank RNG.

    Collective: every rank calls it. ``redraft_state.json`` is written last by rank 0, so a
    checkpoint without it (killed mid-save) is ignored on resume.
    """
    tag = f"step-{state['global_step']}"
    root = out / STATE_DIR
    engine.save_checkpoint(str(root), tag=tag, client_state={"redraft": dict(state)})
    torch.save(rng_state(), root / tag / f"rng_rank{rank}.pt")
    barrier()
    if rank == 0:
        atomic_write_text(root / tag / "redraft_state.json", json.dumps(state, indent=2))
        for old in checkpoint_tags(out)[: -max(1, keep)]:
            shutil.rmtree(root / old, ignore_errors=True)
    barrier()
    return root / tag


def load_checkpoint(engine, out: Path, rank: int) -> dict | None:
    """Restore the newest complete checkpoint into ``engine``; returns our state dict or None."""
    tag = latest_tag(out)
    if tag is None:
        return None
    path, client = engine.load_checkpoint(str(out / STATE_DIR), tag=tag)
    if path is None:
        raise ConfigError(
            f"DeepSpeed could not load the checkpoint {out / STATE_DIR / tag}; "
            f"delete that directory to resume from an older one, or pass --overwrite."
        )
    rng_file = out / STATE_DIR / tag / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return dict(client["redraft"])


def save_run_config(out: Path, cfg_dict: dict, target_record: dict | None = None) -> None:
    """``run_config.yaml``: the resolved settings, then ``target_record`` (what the target was:
    id, tokenizer and weights fingerprints; a record, not a setting, so recipes ignore it)."""
    body = dict(cfg_dict)
    if target_record is not None:
        body["target_record"] = dict(target_record)
    atomic_write_text(out / RUN_CONFIG, yaml.safe_dump(body, sort_keys=False))


def load_run_config(out: Path) -> dict | None:
    p = out / RUN_CONFIG
    return yaml.safe_load(p.read_text()) if p.is_file() else None


# ------------------------------------------------------------------------------ the artifact


def full_state_dict(engine, model) -> dict:
    """The head's weights on CPU (gathered from all ranks under ZeRO-3). Collective."""
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def write_artifact(out: Path, config, state_dict: dict, metrics: dict) -> None:
    """The drafter artifact in ``out``, whole or not at all (rank 0 only).

    ``config``: the head's ReDrafterConfig; ``state_dict``: its weights (CPU tensors);
    ``metrics``: what ``metrics.json`` says. Written into :data:`STAGE_DIR` first, then swapped
    in (:func:`swap_in_artifact`), then the model card is generated from the new files.
    """
    from redraft.models.redrafter import ReDrafter

    stage = out / STAGE_DIR
    if stage.exists():
        shutil.rmtree(stage)
    clean = ReDrafter(config)
    clean.load_state_dict(state_dict)
    clean.save_pretrained(str(stage), safe_serialization=True)
    (stage / METRICS).write_text(json.dumps(metrics, indent=2))
    (stage / STAGE_DONE).write_text("")  # the stage is whole from here on
    swap_in_artifact(out)


def swap_in_artifact(out: Path) -> None:
    """Move a whole staged artifact (:data:`STAGE_DIR` with :data:`STAGE_DONE`) into ``out``.

    Order: remove the old ``config.json`` and card (the directory stops being an artifact),
    move the weights, ``metrics.json`` and any other staged file, then ``config.json`` (a whole
    new artifact again),
    write the card, remove the stage. Idempotent: a swap killed at any point can run again.
    """
    stage = out / STAGE_DIR
    for name in ("config.json", CARD):
        if (stage / "config.json").exists() and (out / name).exists():
            (out / name).unlink()
    rest = sorted(p.name for p in stage.iterdir() if p.name not in ("config.json", STAGE_DONE))
    for name in [*rest, "config.json"]:
        if (stage / name).exists():
            os.replace(stage / name, out / name)
    write_card(out)
    shutil.rmtree(stage)


def write_card(out: Path) -> None:
    """README.md from ``redraft.hub.card.write_model_card`` (the one card writer). A card that cannot
    be written is a warning: the artifact itself is already whole."""
    from redraft.hub.card import write_model_card

    try:
        write_model_card(out)
    except Exception as exc:  # noqa: BLE001 - the weights are safe; say how to make the card later
        logger.warning(
            "model card not written (%s: %s); write it later with "
            "redraft.hub.card.write_model_card(%r)",
            type(exc).__name__,
            exc,
            str(out),
        )


def recover_artifact(out: Path) -> str | None:
    """Finish or discard an artifact write that a killed run left in ``out``.

    Returns ``"completed"`` (a whole staged artifact was swapped in), ``"discarded"`` (a partial
    stage was removed; the previous artifact never changed) or None (nothing to do).
    """
    stage = out / STAGE_DIR
    if not stage.is_dir():
        return None
    if (stage / STAGE_DONE).is_file():
        swap_in_artifact(out)
        return "completed"
    shutil.rmtree(stage)
    return "discarded"
