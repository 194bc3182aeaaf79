"""Publish redraft artifacts to, and load them from, the Hugging Face Hub.

Every function that takes an artifact directory (a trained ReDrafter head, a set of n-gram
tables) also takes ``REPO_ID[@revision]``; :func:`resolve_artifact` is the one place that turns
either into a local directory:

    >>> from redraft.hub import resolve_artifact
    >>> resolve_artifact("checkpoints/redrafter-smollm2")          # a local directory: as is
    >>> resolve_artifact("my-org/redrafter-smollm2@v1", kind="drafter")  # hub cache / download

Hub repos go through ``huggingface_hub.snapshot_download``: its cache (``HF_HUB_CACHE`` /
``HF_HOME``), offline mode (``HF_HUB_OFFLINE=1``) and token (``HF_TOKEN``, ``hf auth login``).

This module imports nothing from the other redraft stages except :mod:`redraft.errors`: the
trainer, the n-gram builder and the decoder all call into it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from redraft.errors import ArtifactError

# Artifact kinds and the file that marks a finished artifact of that kind.
KIND_DRAFTER = "drafter"
KIND_NGRAMS = "ngrams"
KINDS = (KIND_DRAFTER, KIND_NGRAMS)

# ``name`` or ``org/name`` as the Hub spells repo ids (letters, digits, '-', '_', '.').
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")

_TRUTHY = {"1", "on", "yes", "true"}


# --------------------------------------------------------------------------------------------
# Environment (read at call time: huggingface_hub copies these into `constants` at import time,
# so a variable set after the import would otherwise be ignored)
# --------------------------------------------------------------------------------------------


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set to a true value now (or was at import time)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().lower() in _TRUTHY
    return bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir() -> Path:
    """The Hub cache directory: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else the library default."""
    from huggingface_hub import constants

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE).expanduser()


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def split_repo_spec(spec: str) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; ``"org/name"`` -> ``("org/name", None)``."""
    repo, sep, revision = spec.partition("@")
    return repo, (revision or None) if sep else None


def looks_like_repo_id(spec: str) -> bool:
    """Whether ``spec`` (without ``@revision``) could be a Hub repo id rather than a path."""
    repo, _ = split_repo_spec(spec)
    if spec.startswith((".", "/", "~")) or (os.sep != "/" and os.sep in spec):
        return False
    return bool(_REPO_ID.match(repo)) and "--" not in repo and ".." not in repo


def resolve_artifact(spec: str | os.PathLike, *, kind: str | None = None) -> Path:
    """Turn an artifact spec into a local directory.

    Args:
        spec: an existing local directory (returned as is), or a Hub repo id with an optional
            revision, ``"org/name"`` / ``"org/name@v1"`` / ``"org/name@<commit sha>"``, resolved
            with ``huggingface_hub.snapshot_download`` (cache first in offline mode).
        kind: ``"drafter"`` (needs ``config.json`` with model_type ``redrafter``) or
            ``"ngrams"`` (needs ``ngrams.json``); ``None`` checks nothing.

    Returns:
        The directory holding the artifact (for a hub repo: the snapshot in the Hub cache).

    Raises:
        ArtifactError: the path does not exist, the repo is not cached in offline mode or the
            Hub cannot be reached, the repo or revision does not exist, or the directory does
            not hold an artifact of ``kind``.
    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} or None, got {kind!r}")
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        return _check_kind(path, kind, text)
    if path.exists():
        raise ArtifactError(
            f"{path} is a file; an artifact is a directory (config.json + model.safetensors for a "
            f"drafter, ngrams.json + *.safetensors for n-gram tables). Pass the directory."
        )
    if isinstance(spec, os.PathLike) or not looks_like_repo_id(text):
        raise ArtifactError(
            f"Artifact directory {path.absolute()} does not exist. Pass an existing artifact directory or a "
            f"Hugging Face Hub repo id such as 'org/name' or 'org/name@revision'."
        )
    repo_id, revision = split_repo_spec(text)
    return _check_kind(_snapshot(repo_id, revision, local=path.absolute()), kind, text)


def _snapshot(repo_id: str, revision: str | None, local: Path | None = None) -> Path:
    """``snapshot_download`` with errors a user can act on."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = hub_offline()
    cache = hub_cache_dir()
    at = f"{repo_id}@{revision}" if revision else repo_id
    # A relative path such as "checkpoints/run1" also reads as a repo id: say both were tried.
    nolocal = f" (there is no local directory {local} either)" if local is not None else ""
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=cache, local_files_only=offline,
            # Resume-only state is never uploaded; never fetch it either if someone did.
            ignore_patterns=list(RESUME_ONLY_PATTERNS),
        )
    except LocalEntryNotFoundError as exc:
        if offline:
            raise ArtifactError(
                f"Hub repo {at!r} is not in the local Hugging Face cache ({cache}){nolocal} and "
                f"HF_HUB_OFFLINE is set, so it cannot be downloaded. Either unset HF_HUB_OFFLINE "
                f"(needs network access to huggingface.co), download it on a machine with network "
                f"(`hf download {repo_id}{' --revision ' + revision if revision else ''}`) and "
                f"copy the cache here (set HF_HUB_CACHE to it), or pass a local artifact "
                f"directory instead."
            ) from exc
        raise ArtifactError(
            f"Could not reach the Hugging Face Hub to download {at!r}, and it is not in the local "
            f"cache ({cache}){nolocal}: {_first_line(exc)}. Check the network (or HF_ENDPOINT), or "
            f"download it elsewhere and copy the cache here, or pass a local artifact directory."
        ) from exc
    except RevisionNotFoundError as exc:
        raise ArtifactError(
            f"Hub repo {repo_id!r} has no revision {revision!r}. Use a branch, tag or commit that "
            f"exists (see https://huggingface.co/{repo_id}/tree/main)."
        ) from exc
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise ArtifactError(
            f"Hub repo {repo_id!r} was not found or you have no access to it{nolocal}. Check the "
            f"id or path; for a "
            f"private or gated repo, log in with `hf auth login` or set HF_TOKEN."
        ) from exc
    except HfHubHTTPError as exc:
        raise ArtifactError(f"Downloading {at!r} from the Hub failed: {_first_line(exc)}") from exc
    except OSError as exc:  # e.g. IncompleteSnapshotError, a missing token with token=True
        raise ArtifactError(f"Could not resolve Hub repo {at!r}: {_first_line(exc)}") from exc
    return Path(folder)


def _check_kind(path: Path, kind: str | None, spec: str) -> Path:
    """Return ``path`` if it holds an artifact of ``kind`` (or kind is None), else raise."""
    if kind is None:
        return path
    found = artifact_kind(path)
    if found != kind:
        what = {KIND_DRAFTER: "a drafter (config.json with model_type 'redrafter')",
                KIND_NGRAMS: "n-gram tables (ngrams.json)"}[kind]
        has = f"it holds {found} files" if found else f"it holds {_listing(path)}"
        raise ArtifactError(f"{spec!r} ({path}) is not {what}: {has}.")
    return path


def artifact_kind(path: str | os.PathLike) -> str | None:
    """``"drafter"``, ``"ngrams"`` or ``None`` from the marker file in directory ``path``."""
    import json

    path = Path(path)
    if (path / "ngrams.json").is_file():
        return KIND_NGRAMS
    config = path / "config.json"
    if config.is_file():
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError) as exc:
            raise ArtifactError(f"{config} is not valid JSON ({exc}); re-create the artifact.") from exc
        if model_type == "redrafter":
            return KIND_DRAFTER
    return None


def _listing(path: Path, limit: int = 8) -> str:
    names = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if not names:
        return "no files"
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# Files only a resumed training run needs; never uploaded, never downloaded.
RESUME_ONLY_PATTERNS = ("training_state/**", "training_state/*", "*.tmp", "*.tmp*", "**/*.tmp*",
                        "*.lock", "events.out.tfevents*", "**/events.out.tfevents*")
