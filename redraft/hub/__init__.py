"""Publish redraft artifacts to, and load them from, the Hugging Face Hub.

Everything that takes an artifact directory (a ReDrafter head, n-gram tables) also takes
``REPO_ID[@revision]``: :func:`resolve_artifact` turns either into a local directory
(``resolve_artifact("my-org/redrafter-smollm2@v1", kind="drafter")``). The Hub side is
huggingface_hub's: ``snapshot_download`` (its cache, ``HF_HUB_OFFLINE``, ``HF_TOKEN``),
``validate_repo_id``, ``ModelCard`` and ``HfApi.create_commit``.

Three modules, in import order (none imports one after it):

* :mod:`redraft.hub.resolve`: the artifact kinds, their manifests, resolving and downloading;
  no other redraft stage, so every stage that loads artifacts imports it;
* :mod:`redraft.hub.card`: the model card (``card.md`` is its template);
* :mod:`redraft.hub.push`: the finished-artifact check, the push and ``redraft-push``.

The names below are imported on first use, so that ``import redraft.hub.resolve`` (what the
loading stages need) does not import the push and its drafter check.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BENCH_FILE": "redraft.hub.resolve",
    "CARD_FILE": "redraft.hub.resolve",
    "KIND_DRAFTER": "redraft.hub.resolve",
    "KIND_NGRAMS": "redraft.hub.resolve",
    "KINDS": "redraft.hub.resolve",
    "METRICS_FILE": "redraft.hub.resolve",
    "NGRAMS_FILE": "redraft.hub.resolve",
    "NOT_ARTIFACT": "redraft.hub.resolve",
    "RUN_CONFIG_FILE": "redraft.hub.resolve",
    "artifact_kind": "redraft.hub.resolve",
    "hub_cache_dir": "redraft.hub.resolve",
    "hub_offline": "redraft.hub.resolve",
    "looks_like_repo_id": "redraft.hub.resolve",
    "manifest": "redraft.hub.resolve",
    "resolve_artifact": "redraft.hub.resolve",
    "dataset_ids": "redraft.hub.card",
    "generate_model_card": "redraft.hub.card",
    "write_model_card": "redraft.hub.card",
    "check_finished": "redraft.hub.push",
    "push_artifact": "redraft.hub.push",
    "push_main": "redraft.hub.push",
    "upload_files": "redraft.hub.push",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'redraft.hub' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
