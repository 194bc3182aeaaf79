"""Reading and checking ReDrafter artifacts: redraft's layout and Apple's, local or from the hub.

    check_artifact(dir)          config types, tensor names and shapes, the recorded sha256 (no weights read)
    read_drafter(path)           the head alone, checked, on the CPU
    load_drafter(path, target)   the head for a target: its tokenizer fingerprint checked, embedding attached

Writing is :meth:`redraft.models.redrafter.ReDrafter.save_pretrained`; Apple's layout is
:mod:`redraft.models.apple`; the strict checks themselves are :mod:`redraft.models.artifact`.
"""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path

import torch

from redraft.errors import ArtifactError, RedraftError
from redraft.models import artifact
from redraft.models.redrafter import (
    ReDrafter,
    check_artifact,
    expected_shapes,
    parse_config,
)  # noqa: F401
from redraft.models.redrafter_config import MODEL_TYPE, ReDrafterConfig
from redraft.models.target import Target, check_fingerprint
from redraft.utils import resolve_dtype

__all__ = ["check_artifact", "expected_shapes", "load_drafter", "parse_config", "read_drafter"]


def _resolve(path) -> Path:
    """A local directory, or ``REPO_ID[@rev]`` through ``redraft.hub.resolve.resolve_artifact`` when the
    hub module exists."""
    p = Path(os.path.expanduser(str(path)))
    if p.exists():
        return p
    try:
        hub = importlib.import_module("redraft.hub.resolve")
    except ImportError:
        hub = None
    if hub is not None and hasattr(hub, "resolve_artifact"):
        return Path(hub.resolve_artifact(str(path)))
    raise ArtifactError(
        f"Drafter artifact {path} does not exist. Pass the directory redraft-train wrote "
        f"(it holds config.json and model.safetensors) or a hub id REPO_ID[@revision]."
    )


def read_drafter(path, dtype: torch.dtype | str | None = None, *, verify: bool = True) -> ReDrafter:
    """Load a drafter artifact (redraft's layout or Apple's) without a target: checked exactly
    (:mod:`redraft.models.artifact`), no embedding attached, on the CPU, eval mode.

    Args:
        path: artifact directory or hub ``REPO_ID[@rev]``.
        dtype: weights dtype; ``None`` keeps the stored one.
        verify: check the weights against the sha256 recorded in ``config.json``.
    """
    p = _resolve(path)
    raw = artifact.read_config_json(p)
    dtype = None if dtype is None else resolve_dtype(dtype)
    if raw.get("model_type") == _apple().APPLE_MODEL_TYPE:
        return _apple().read_apple_drafter(p, ReDrafter, raw, dtype=dtype, verify=verify).eval()
    parse_config(raw, p)  # the model_type and value checks first, with the file's name
    try:
        model = ReDrafter.from_pretrained(str(p), dtype=dtype or "auto", verify=verify)
    except RedraftError:
        raise
    except Exception as exc:
        raise ArtifactError(
            f"Could not load the drafter weights from {p} ({type(exc).__name__}: {exc}). The "
            f"directory should hold model.safetensors as written by redraft-train."
        ) from exc
    return model.eval()


def _apple():
    from redraft.models import apple  # on use: only Apple-layout heads need it

    return apple


def load_drafter(
    path, target: Target, dtype: torch.dtype | str | None = None, *, verify: bool = True
) -> ReDrafter:
    """Load a drafter artifact for ``target``: check it exactly, check its tokenizer fingerprint,
    attach the target's input embedding, move it to the target's device, eval mode.

    Reads redraft's layout (model_type ``redrafter``) and Apple's ml-recurrent-drafter layout
    (model_type ``recurrent_drafting_drafter``, as ``redraft-export`` writes it or Apple's
    trainer does). A head in Apple's layout that records no tokenizer fingerprint (trained with
    Apple's code) is checked against the target's sizes only, with a warning.

    Args:
        path: artifact directory (or ``REPO_ID[@rev]`` through ``redraft.hub``).
        target: the loaded :class:`~redraft.models.target.Target`.
        dtype: weights dtype; default the target's dtype.
        verify: check the weights against the sha256 recorded at write time.

    Raises:
        ArtifactError: the directory is missing, not a drafter, or its weights do not match its
            config exactly (names the key), or were changed since they were written.
        FingerprintMismatchError: the drafter was trained for another tokenizer (names both).
    """
    p = _resolve(path)
    raw = artifact.read_config_json(p)
    dtype = target.dtype if dtype is None else resolve_dtype(dtype)
    if raw.get("model_type") == _apple().APPLE_MODEL_TYPE:
        config = _apple().config_from_apple(raw, p, ReDrafterConfig)
    else:
        config = parse_config(raw, p)
    if config.tokenizer_fingerprint is None and raw.get("model_type") != MODEL_TYPE:
        _check_sizes(config, target, p)
        warnings.warn(
            f"{p} records no tokenizer fingerprint (a head trained outside redraft); only its sizes "
            f"were checked against {target.model_id!r}. Make sure it was trained for this target.",
            UserWarning,
            stacklevel=2,
        )
    else:
        check_fingerprint(config.tokenizer_fingerprint, target, p)
    drafter = read_drafter(p, dtype=dtype, verify=verify)
    drafter.attach_target(target)
    return drafter.to(target.device).eval()


def _check_sizes(config: ReDrafterConfig, target: Target, where: Path) -> None:
    E = target.input_embedding.weight
    want = {
        "vocab_size": int(E.shape[0]),
        "hidden_size": int(target.hidden_size),
        "embedding_dim": int(E.shape[1]),
    }
    for key, value in want.items():
        if getattr(config, key) != value:
            raise ArtifactError(
                f"{where / artifact.CONFIG_NAME} has {key}={getattr(config, key)}, but target "
                f"{target.model_id!r} has {value}: the head was trained for another model."
            )
