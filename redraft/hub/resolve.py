"""Where a redraft artifact comes from and which files make it: the artifact kinds and their
manifests, and :func:`resolve_artifact` (a local directory, or ``REPO_ID[@revision]`` through
huggingface_hub's ``snapshot_download`` and its cache).

The lowest of the Hub modules: it imports no other redraft stage, so every stage (models,
ngrams, infer) can resolve artifacts through it. :mod:`redraft.hub.card` builds the model card
from the files named here, and :mod:`redraft.hub.push` publishes (its push checks a drafter with
:mod:`redraft.models`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError, safe_open

from redraft.errors import ArtifactError
from redraft.utils import split_revision

KIND_DRAFTER, KIND_NGRAMS = "drafter", "ngrams"
KINDS = (KIND_DRAFTER, KIND_NGRAMS)
CARD_FILE, NGRAMS_FILE = "README.md", "ngrams.json"
# What redraft-train writes beside the head, and what `redraft-bench --out DIR/bench.json` writes.
METRICS_FILE, RUN_CONFIG_FILE, BENCH_FILE = "metrics.json", "run_config.yaml", "bench.json"
# metrics.json "status" of a run that ended normally: every step done, or --max-time-minutes reached.
# Never part of a published artifact (never downloaded; uploaded only if --include asks): resume
# state, logs, sharded tri-gram counts, partial writes.
NOT_ARTIFACT = ["training_state/**", "tensorboard/**", "trigram-counts-*/**", "*.tmp*", "**/*.tmp*"]


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as set now (huggingface_hub reads it once, at import time)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    return (
        bool(constants.HF_HUB_OFFLINE)
        if value is None
        else value.strip().lower() in ("1", "on", "yes", "true")
    )


def hub_cache_dir() -> Path:
    """The Hub cache as set now: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else the library's."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE).expanduser()


def looks_like_repo_id(spec: str) -> bool:
    """Whether ``spec`` (``REPO_ID[@revision]``) is a valid Hub repo id (``validate_repo_id``)."""
    try:
        validate_repo_id(split_revision(spec)[0])
    except HFValidationError:
        return False
    return True


def resolve_artifact(spec: str | os.PathLike, *, kind: str | None = None) -> Path:
    """An existing local directory (as is) or ``org/name[@revision]`` (its snapshot in the Hub
    cache, via ``snapshot_download``) -> the local directory holding the artifact.

    ``kind``: ``"drafter"`` (``config.json`` with model_type ``redrafter``), ``"ngrams"``
    (``ngrams.json``) or ``None`` (no check). Raises ArtifactError when the path does not exist,
    the repo is not cached offline or the Hub is unreachable, the repo or revision does not
    exist, or the directory does not hold an artifact of ``kind``.
    """
    if kind not in (None, *KINDS):
        raise ValueError(f"kind must be one of {KINDS} or None, got {kind!r}")
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        return _check_kind(path, kind, text)
    if path.exists():
        raise ArtifactError(
            f"{path} is a file; an artifact is a directory (config.json + model.safetensors "
            f"for a drafter, ngrams.json + *.safetensors for n-gram tables). Pass the directory."
        )
    if isinstance(spec, os.PathLike) or not looks_like_repo_id(text):
        raise ArtifactError(
            f"Artifact directory {path.absolute()} does not exist. Pass an existing artifact "
            f"directory or a Hugging Face Hub repo id such as 'org/name' or 'org/name@revision'."
        )
    repo_id, revision = split_revision(text)
    at, offline, cache = text, hub_offline(), hub_cache_dir()
    # A relative path such as "checkpoints/run1" also reads as a repo id: say both were tried.
    nolocal = f" (there is no local directory {path.absolute()} either)"
    try:
        snapshot = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache,
                local_files_only=offline,
                ignore_patterns=NOT_ARTIFACT,
            )
        )
    except LocalEntryNotFoundError as exc:
        why = (
            "HF_HUB_OFFLINE is set, so it cannot be downloaded. Either unset HF_HUB_OFFLINE (needs "
            "network access to huggingface.co), or"
            if offline
            else f"and the Hub could not be reached ({first_line(exc)}). Check the network (HF_ENDPOINT), or"
        )
        raise ArtifactError(
            f"Hub repo {at!r} is not in the local Hugging Face cache ({cache}){nolocal}, {why} download it "
            f"on a machine with network (`hf download {repo_id}{' --revision ' + revision if revision else ''}`)"
            f" and copy the cache here (set HF_HUB_CACHE to it), or pass a local artifact directory."
        ) from exc
    except RevisionNotFoundError as exc:
        raise ArtifactError(
            f"Hub repo {repo_id!r} has no revision {revision!r}. Use a branch, tag or commit "
            f"that exists (see https://huggingface.co/{repo_id}/tree/main)."
        ) from exc
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise ArtifactError(
            f"Hub repo {repo_id!r} was not found or you have no access to it{nolocal}. Check "
            f"the id or path; for a private or gated repo, log in with `hf auth login` or set "
            f"HF_TOKEN."
        ) from exc
    except (HfHubHTTPError, OSError) as exc:  # OSError: e.g. an incomplete snapshot
        raise ArtifactError(f"Downloading {at!r} from the Hub failed: {first_line(exc)}") from exc
    return _check_kind(snapshot, kind, text)


def _check_kind(path: Path, kind: str | None, spec: str) -> Path:
    found = artifact_kind(path) if kind else None
    if kind and found != kind:
        what = {
            KIND_DRAFTER: "a drafter (config.json with model_type 'redrafter')",
            KIND_NGRAMS: "n-gram tables (ngrams.json)",
        }[kind]
        raise ArtifactError(
            f"{spec!r} ({path}) is not {what}: it holds "
            f"{f'{found} files' if found else _listing(path)}."
        )
    return path


def artifact_kind(path: str | os.PathLike) -> str | None:
    """``"drafter"``, ``"ngrams"`` or ``None``, from the manifest in directory ``path``."""
    path = Path(path)
    if (path / NGRAMS_FILE).is_file():
        return KIND_NGRAMS
    config = path / "config.json"
    return (
        KIND_DRAFTER
        if config.is_file() and read_json(config).get("model_type") == "redrafter"
        else None
    )


def require_kind(root: Path) -> str:
    """The kind of the artifact in ``root``; ArtifactError (listing what is there) when it is none."""
    kind = artifact_kind(root)
    if kind is None:
        raise ArtifactError(
            f"{root} is not a finished redraft artifact: it holds neither config.json (model_type "
            f"'redrafter') + model.safetensors nor {NGRAMS_FILE} + the tables it lists, but "
            f"{_listing(root)}. Point at the output directory of a finished run."
        )
    return kind


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; ArtifactError when it is unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc}); re-create the artifact.") from exc
    if not isinstance(data, dict):
        raise ArtifactError(
            f"{path} holds a JSON {type(data).__name__}, not an object; re-create the artifact."
        )
    return data


def _listing(path: Path, limit: int = 8) -> str:
    names = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "no files"


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` of ``exc``, for one-line errors."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# --- What a finished artifact is ---------------------------------------------------------------


def safetensors_header(path: Path) -> dict[str, tuple[list[int], str]]:
    """Name -> (shape, dtype) of a safetensors file; ArtifactError if it is truncated or not one
    (``safe_open`` checks that the header's offsets cover the file exactly)."""
    try:
        with safe_open(str(path), "numpy") as f:
            return {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise ArtifactError(
            f"{path} is truncated or not a safetensors file ({exc}); it was probably cut off "
            f"while being written. Re-run the save that wrote it."
        ) from exc


def manifest(root: Path, kind: str) -> tuple[list[str], list[str]]:
    """(required, optional) files of the artifact, as its manifest names them."""
    if kind == KIND_DRAFTER:
        index = root / "model.safetensors.index.json"
        weights = (
            [index.name, *sorted(set(read_json(index).get("weight_map", {}).values()))]
            if index.is_file()
            else ["model.safetensors"]
        )
        # the module auto_map names (AutoModel with trust_remote_code reads it from the repo)
        auto_map = read_json(root / "config.json").get("auto_map") or {}
        remote = sorted({v.split(".")[0] + ".py" for v in auto_map.values() if isinstance(v, str)})
        return ["config.json", *weights, *remote], [
            METRICS_FILE,
            RUN_CONFIG_FILE,
            BENCH_FILE,
            CARD_FILE,
        ]
    files = read_json(root / NGRAMS_FILE).get("files")
    if (
        not files
        or not isinstance(files, dict)
        or not all(isinstance(v, dict) and isinstance(v.get("file"), str) for v in files.values())
    ):
        raise ArtifactError(
            f"{root / NGRAMS_FILE} names no table files ('files' is {files!r}, expected "
            f"kind -> {{file, bytes, sha256}}). Re-run redraft-build-ngrams into {root}."
        )
    return [NGRAMS_FILE, *(v["file"] for v in files.values())], [BENCH_FILE, CARD_FILE]
