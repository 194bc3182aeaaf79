"""Run directory, checkpoints (DeepSpeed) and the drafter artifact.

Layout of ``<output_dir>``::

    config.json, model.safetensors, README.md   the drafter artifact (load_drafter reads these)
    metrics.json                                train / held-out figures of the last run
    run_config.yaml                             the resolved TrainConfig
    training_state/step-<N>/                    DeepSpeed checkpoints (+ our client state, RNG)
    tensorboard/                                event files
"""

from __future__ import annotations

import json
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

STATE_DIR = "training_state"
RUN_FILES = ("run_config.yaml", STATE_DIR, "model.safetensors", "config.json", "README.md", "metrics.json",
             "tensorboard")


def prepare_output_dir(out: Path, resume: bool, overwrite: bool, rank: int) -> bool:
    """Check the run directory; returns True when it holds a run to resume.

    An existing run (any of :data:`RUN_FILES`) needs ``resume`` or ``overwrite``; ``overwrite``
    deletes only those entries (never anything else the directory holds).
    """
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found and not (resume or overwrite):
        raise ConfigError(
            f"Output directory {out} already holds a run ({', '.join(found)}). Pass --resume to "
            f"continue it, --overwrite to replace it, or choose another --output-dir."
        )
    if found and overwrite and not resume and rank == 0:
        for name in found:
            p = out / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    return bool(found) and resume


def latest_tag(out: Path) -> str | None:
    tags = checkpoint_tags(out)
    return tags[-1] if tags else None


def checkpoint_tags(out: Path) -> list[str]:
    """Complete checkpoints (those with our client file), oldest first."""
    d = out / STATE_DIR
    if not d.is_dir():
        return []
    tags = [p.name for p in d.iterdir() if p.is_dir() and re.fullmatch(r"step-\d+", p.name)
            and (p / "redraft_state.json").is_file()]
    return sorted(tags, key=lambda t: int(t.split("-")[1]))


def rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
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
        for old in checkpoint_tags(out)[:-max(1, keep)]:
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
        raise ConfigError(f"DeepSpeed could not load the checkpoint {out / STATE_DIR / tag}; "
                          f"delete that directory to resume from an older one, or pass --overwrite.")
    rng_file = out / STATE_DIR / tag / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return dict(client["redraft"])


def save_run_config(out: Path, cfg_dict: dict) -> None:
    atomic_write_text(out / "run_config.yaml", yaml.safe_dump(cfg_dict, sort_keys=False))


def load_run_config(out: Path) -> dict | None:
    p = out / "run_config.yaml"
    return yaml.safe_load(p.read_text()) if p.is_file() else None


def model_card(drafter_config, metrics: dict, cfg_dict: dict) -> str:
    """A minimal model card (used when redraft.hub.generate_model_card is not available)."""
    c = drafter_config
    top1 = ", ".join(f"{a:.3f}" for a in metrics.get("eval_top1", []))
    return f"""---
library_name: redraft
tags: [speculative-decoding, redrafter, draft-model]
base_model: {c.target_model}
---
# ReDrafter draft head for `{c.target_model}`

A ReDrafter head (recurrent drafter; Zhang et al., 2024) trained with
[redraft](https://github.com/) for lossless speculative decoding of `{c.target_model}`.
It holds only the head's own weights; the target's input embedding is shared at load time.

| | |
|---|---|
| target | `{c.target_model}` (vocab {c.vocab_size}, hidden {c.hidden_size}) |
| tokenizer fingerprint | `{c.tokenizer_fingerprint}` |
| head | {c.num_layers} ResNet blocks, rnn={c.rnn}, draft vocab {c.draft_vocab_size or 'full'} |
| training horizon | {c.num_steps} steps |
| data | `{cfg_dict.get('data')}` |
| held-out top-1 by position | {top1 or 'n/a'} |
| held-out tau_est | {metrics.get('eval_tau_est', float('nan')):.3f} |

## Use
```python
from redraft.models import load_target
from redraft.models.redrafter import load_drafter
target = load_target({cfg_dict.get('target')!r})
drafter = load_drafter("path/or/REPO_ID", target)
```
"""
