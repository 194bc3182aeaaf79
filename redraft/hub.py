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

import argparse
import json
import logging
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import yaml
from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import filter_repo_objects

from redraft.errors import ArtifactError, RedraftError
from redraft.utils import atomic_write_text, split_revision

logger = logging.getLogger(__name__)

# Artifact kinds and the file that marks a finished artifact of that kind.
KIND_DRAFTER = "drafter"
KIND_NGRAMS = "ngrams"
KINDS = (KIND_DRAFTER, KIND_NGRAMS)

# ``name`` or ``org/name`` as the Hub spells repo ids (letters, digits, '-', '_', '.').
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")

_TRUTHY = {"1", "on", "yes", "true"}

# Files that only a resumed training run needs (optimizer, scheduler, RNG, data position; DeepSpeed
# checkpoint folders) or that are half written: never uploaded, never downloaded.
RESUME_ONLY_PATTERNS = (
    "training_state/**", "global_step*/**", "latest", "zero_to_fp32.py",
    "*.tmp*", "**/*.tmp*", "*.lock", "**/*.lock", "**/__pycache__/**", ".git/**", ".cache/**",
)


# --------------------------------------------------------------------------------------------
# Environment (read at call time: huggingface_hub copies these into `constants` at import time,
# so a variable set after the import would otherwise be ignored)
# --------------------------------------------------------------------------------------------


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set to a true value now (or was at import time)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().lower() in _TRUTHY
    return bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir() -> Path:
    """The Hub cache directory: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else the library default."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE).expanduser()


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def looks_like_repo_id(spec: str) -> bool:
    """Whether ``spec`` (without ``@revision``) could be a Hub repo id rather than a path."""
    repo, _ = split_revision(spec)
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
            f"Artifact directory {path.absolute()} does not exist. Pass an existing artifact "
            f"directory or a Hugging Face Hub repo id such as 'org/name' or 'org/name@revision'."
        )
    repo_id, revision = split_revision(text)
    return _check_kind(_snapshot(repo_id, revision, local=path.absolute()), kind, text)


def _snapshot(repo_id: str, revision: str | None, local: Path | None = None) -> Path:
    """``snapshot_download`` with errors a user can act on."""
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
            f"id or path; for a private or gated repo, log in with `hf auth login` or set HF_TOKEN."
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


# --------------------------------------------------------------------------------------------
# What an artifact directory holds
# --------------------------------------------------------------------------------------------

# The trainer saves its resolved config with the run; the first of these found is the recipe.
RECIPE_FILES = ("resolved_config.yaml", "train_config.yaml", "run_config.yaml", "recipe.yaml",
                "resolved_config.json", "train_config.json", "run_config.json", "training_args.json")
# Benchmark results (redraft-bench JSON) kept beside the artifact, first found wins.
BENCH_FILES = ("bench.json", "bench_results.json", "benchmark.json", "bench/results.json")
METRICS_FILE = "metrics.json"
CARD_FILE = "README.md"

# Where a data spec (redraft.data) names a Hub dataset, or the embedded default's source.
DEFAULT_DATASETS = {"default-chat": "anon8231489123/ShareGPT_Vicuna_unfiltered"}
HUB_DATA_KINDS = ("sharegpt", "ultrachat", "stack")
_DATA_KEYS = ("data", "dataset", "datasets", "train_data", "data_spec", "data_specs", "corpus",
              "eval_data", "sources")
_TARGET_KEYS = ("target_model", "target", "target_id", "target_model_id", "base_model")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc}); re-create the artifact.") from exc
    return data


def _read_recipe(artifact: Path) -> tuple[str | None, dict | None]:
    """(file name, parsed dict) of the resolved training config saved with the run, if any."""
    for name in RECIPE_FILES:
        path = artifact / name
        if path.is_file():
            text = path.read_text()
            try:
                data = json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
            except (ValueError, yaml.YAMLError) as exc:
                raise ArtifactError(f"{path} cannot be parsed ({exc}); fix or delete it.") from exc
            return name, data if isinstance(data, dict) else {"value": data}
    return None, None


def _find_key(obj, keys: tuple[str, ...]):
    """The first value under any of ``keys`` in a nested dict (breadth first), else None."""
    queue = [obj]
    while queue:
        node = queue.pop(0)
        if isinstance(node, dict):
            for key in keys:
                if node.get(key) not in (None, "", [], {}):
                    return node[key]
            queue.extend(v for v in node.values() if isinstance(v, dict))
    return None


def _strip_revision(repo: str) -> str:
    return repo.split("@", 1)[0]


def _hub_id(value) -> str | None:
    """``value`` if it reads as a Hub repo id (not a local path), without ``@revision``."""
    if not isinstance(value, str) or not value or os.path.isabs(value) or os.path.exists(value):
        return None
    repo = _strip_revision(value)
    return repo if "/" in repo and looks_like_repo_id(repo) else None


def dataset_ids(specs) -> list[str]:
    """Hub dataset ids named by redraft data specs, for the card's ``datasets`` metadata.

    Understands the :mod:`redraft.data` grammar (``[WEIGHT*]KIND[:ARG][?OPTIONS]``, components
    joined by ``,``): ``sharegpt:`` / ``ultrachat:`` / ``stack:`` with a hub id give that id,
    ``default-chat`` gives the ShareGPT dataset it ships; local files and folders, ``code-dir:``
    and ``default-code`` (the Python standard library) are left out, since the metadata may only
    name Hub datasets. ``specs`` is a spec string, a list of them, or a list of dicts with a
    ``spec`` key.
    """
    if specs is None:
        return []
    items = specs if isinstance(specs, (list, tuple)) else [specs]
    components = []
    for item in items:
        if isinstance(item, dict):
            item = item.get("spec") or item.get("data") or ""
        components += str(item).split(",")
    out: list[str] = []
    for comp in components:
        comp = comp.strip()
        head, star, rest = comp.partition("*")
        if star and re.fullmatch(r"[0-9.eE+-]+", head.strip()):
            comp = rest.strip()  # "0.7*default-chat": drop the weight
        body = comp.split("?", 1)[0]
        kind, _, arg = body.partition(":")
        if kind in DEFAULT_DATASETS:
            ds = DEFAULT_DATASETS[kind]
        elif kind in HUB_DATA_KINDS:
            ds = _hub_id(arg)
        else:
            ds = None
        if ds and ds not in out:
            out.append(ds)
    return out


def _safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file; ArtifactError if it is truncated or not one.

    Layout: 8 bytes little-endian header length N, N bytes of JSON, then the tensor data; the
    largest ``data_offsets`` end must equal the data size, so a cut-off file is caught here.
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
    except (struct.error, ValueError) as exc:
        raise ArtifactError(
            f"{path} is not a complete safetensors file ({exc}); it was probably cut off while "
            f"being written. Re-run the save (or the training run's final checkpoint)."
        ) from exc
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ArtifactError(
            f"{path} is truncated: its header describes {8 + n + end} bytes but the file has "
            f"{size}. Re-run the save (or the training run's final checkpoint)."
        )
    return header


def upload_files(artifact_dir: str | os.PathLike) -> list[str]:
    """Relative POSIX paths of the files :func:`push_artifact` uploads (resume-only files left out)."""
    root = Path(artifact_dir)
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    keep = set(filter_repo_objects(files, ignore_patterns=list(RESUME_ONLY_PATTERNS)))
    return [f for f in files if f in keep]


def check_finished(artifact_dir: str | os.PathLike) -> str:
    """Check that ``artifact_dir`` holds a finished artifact; return its kind.

    A drafter needs ``config.json`` (model_type ``redrafter``) and ``model.safetensors`` (or a
    sharded ``model.safetensors.index.json`` with every shard); n-gram tables need ``ngrams.json``
    and at least one ``*.safetensors`` (and every table file that ``ngrams.json`` names). Every
    safetensors file must be complete, and no half-written ``*.tmp*`` file may be present outside
    ``training_state/``.

    Raises:
        ArtifactError: naming the missing or partial file and what to do.
    """
    root = Path(artifact_dir)
    if not root.is_dir():
        raise ArtifactError(f"Artifact directory {root} does not exist or is not a directory.")
    all_files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    resume_only = set(filter_repo_objects(all_files, allow_patterns=["training_state/**",
                                                                    "global_step*/**"]))
    partial = [f for f in all_files if ".tmp" in Path(f).name and f not in resume_only]
    if partial:
        raise ArtifactError(
            f"{root} holds partial files ({', '.join(partial[:5])}): a save is still running or was "
            f"interrupted. Wait for the run to finish (or resume it) and push again; delete them "
            f"if you are sure they are leftovers."
        )
    kind = artifact_kind(root)
    if kind is None:
        raise ArtifactError(
            f"{root} is not a finished redraft artifact: it holds {_listing(root)}. A drafter needs "
            f"config.json (model_type 'redrafter') + model.safetensors; n-gram tables need "
            f"ngrams.json + *.safetensors. Point at the run's output directory after it finished."
        )
    if kind == KIND_DRAFTER:
        index = root / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
            weights = [root / s for s in shards]
        else:
            weights = [root / "model.safetensors"]
        missing = [w.name for w in weights if not w.is_file()]
        if missing or not weights:
            raise ArtifactError(
                f"{root} has config.json but no {', '.join(missing) or 'weights'}: the drafter was "
                f"not saved completely. Wait for training to finish or re-run its final save."
            )
    else:
        weights = [root / f for f in all_files
                   if f.endswith(".safetensors") and f not in resume_only]
        # Table files ngrams.json names (relative paths; build args may hold absolute ones).
        named = {v for v in _walk_strings(_read_json(root / "ngrams.json"))
                 if v.endswith(".safetensors") and not os.path.isabs(v)}
        missing = sorted(n for n in named if not (root / n).is_file())
        if not weights or missing:
            lack = ", ".join(missing) if missing else "*.safetensors tables"
            raise ArtifactError(
                f"{root} has ngrams.json but no {lack}: the build did not finish. Re-run "
                f"redraft-build-ngrams into this directory."
            )
    for w in weights:
        _safetensors_header(w)
    return kind


def _walk_strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk_strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk_strings(v)


# --------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------

# PretrainedConfig boilerplate that says nothing about the head.
_CONFIG_NOISE = {
    "architectures", "transformers_version", "torch_dtype", "dtype", "return_dict",
    "output_hidden_states", "output_attentions", "use_cache", "tie_word_embeddings",
    "is_encoder_decoder", "chunk_size_feed_forward", "problem_type", "model_type",
    "tokenizer_fingerprint", "target_model", "auto_map", "id2label", "label2id",
}

# Filled by :func:`generate_model_card`; {repo} is the repo id (or the local directory), {flag}
# the redraft-bench flag, {kind} the resolve_artifact kind and {what} what the directory holds.
USAGE = """\
```bash
# with redraft installed (pip install -e . in a redraft checkout)
redraft-bench --target {target} --{flag} {repo}
```

```python
from redraft.hub import resolve_artifact

# Downloads once into the Hugging Face cache (HF_HUB_OFFLINE=1 then loads from the cache).
{var} = resolve_artifact("{repo}", kind="{kind}")
# Every redraft API and CLI that takes {what} also takes "{repo}" directly.
```
"""
USAGE_FIELDS = {
    "drafter": dict(flag="drafter", var="drafter_dir", what="a drafter directory"),
    "ngrams": dict(flag="ngrams", var="tables_dir", what="an n-gram table directory"),
}


def _fmt(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:.1f}"
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _bench_rows(bench) -> list[dict]:
    """Per-method records from redraft-bench JSON in any of its likely shapes."""
    if isinstance(bench, dict):
        for key in ("methods", "results", "rows"):
            if key in bench:
                return _bench_rows(bench[key])
        if all(isinstance(v, dict) for v in bench.values()):
            return [{"method": k, **v} for k, v in bench.items()]
        return []
    if isinstance(bench, list):
        return [r for r in bench if isinstance(r, dict)]
    return []


_BENCH_COLUMNS = (("tokens_per_call", "tokens / call"), ("tokens_per_s", "tokens / s"),
                  ("speedup_vs_ar", "speedup vs greedy"), ("identical_to_ar", "identical to greedy"))


def _bench_section(artifact: Path) -> str | None:
    for name in BENCH_FILES:
        path = artifact / name
        if not path.is_file():
            continue
        bench = _read_json(path)
        rows = _bench_rows(bench)
        if not rows:
            continue
        cols = [(k, t) for k, t in _BENCH_COLUMNS if any(k in r for r in rows)]
        body = _table(["method"] + [t for _, t in cols],
                      [[r.get("method") or r.get("name", "?")] + [r.get(k, "") for k, _ in cols]
                       for r in rows])
        setting = {k: v for k, v in bench.items() if isinstance(v, (str, int, float, bool))} \
            if isinstance(bench, dict) else {}
        where = ", ".join(f"{k}: {_fmt(v)}" for k, v in setting.items())
        return (f"Measured with `redraft-bench` (from `{name}`){'; ' + where if where else ''}. "
                f"Baseline and candidates ran in the same process; speedups are ratios to plain "
                f"greedy decoding of the same target.\n\n{body}")
    md = artifact / "bench.md"
    return md.read_text().strip() if md.is_file() else None


def _metrics_section(metrics: dict) -> str:
    """Per-position accuracy table (list-valued metrics) and the scalar metrics.

    Nested dicts are flattened one level (``{"eval": {"top1": [...]}}`` -> ``eval.top1``).
    """
    flat = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    metrics = flat
    lists = {k: v for k, v in metrics.items()
             if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v)}
    parts = []
    if lists:
        n = max(len(v) for v in lists.values())
        rows = [[i + 1] + [v[i] if i < len(v) else "" for v in lists.values()] for i in range(n)]
        parts.append("Per draft position (position 1 is the first token after the target's own):\n\n"
                     + _table(["position"] + list(lists), rows))
    tau_keys = ("eval_tau_est", "tau_est", "eval.tau_est")
    tau = next((metrics[k] for k in tau_keys if k in metrics), None)
    if tau is not None:
        parts.append(f"**Estimated acceptance length tau_est = {_fmt(tau)}** tokens per target call "
                     f"(`1 + sum_k chain_acc_k`: the expected tokens per call when each position's "
                     f"chain accuracy is its acceptance rate).")
    scalars = [[k, v] for k, v in metrics.items()
               if isinstance(v, (int, float, str, bool)) and k not in tau_keys]
    if scalars:
        parts.append(_table(["metric", "value"], scalars))
    return "\n\n".join(parts)


def generate_model_card(artifact_dir: str | os.PathLike, *, repo_id: str | None = None,
                        license: str = "apache-2.0", base_model: str | None = None) -> str:
    """Render the Hub model card (``README.md`` text) for a drafter or n-gram artifact.

    Reads ``config.json`` (drafter) or ``ngrams.json`` (n-gram tables), and when present
    ``metrics.json`` (held-out accuracy per position, ``eval_tau_est``), the resolved training
    config (:data:`RECIPE_FILES`) and benchmark results (:data:`BENCH_FILES` / ``bench.md``).

    Args:
        artifact_dir: the artifact directory.
        repo_id: the repo it is published as (used in the title and the usage snippet).
        license: the ``license`` metadata (a Hub license id).
        base_model: overrides the target id recorded in the artifact.

    Returns:
        Markdown with YAML front matter: ``library_name: redraft``, ``base_model`` (when the
        target is a Hub id), ``tags``, ``license``, ``datasets`` (Hub datasets only).
    """
    root = Path(artifact_dir)
    kind = artifact_kind(root)
    if kind is None:
        raise ArtifactError(f"{root} holds neither config.json (model_type 'redrafter') nor "
                            f"ngrams.json, so there is no artifact to describe ({_listing(root)}).")
    config = _read_json(root / ("config.json" if kind == KIND_DRAFTER else "ngrams.json"))
    metrics = _read_json(root / METRICS_FILE) if (root / METRICS_FILE).is_file() else {}
    recipe_name, recipe = _read_recipe(root)

    target = base_model or _find_key(config, _TARGET_KEYS) or _find_key(recipe or {}, _TARGET_KEYS)
    target = str(target) if target else None
    base = _hub_id(target) if target else None
    data_specs = _find_key(config, _DATA_KEYS) or _find_key(recipe or {}, _DATA_KEYS)
    datasets = dataset_ids(data_specs)
    name = repo_id or root.resolve().name

    tags = ["redraft", "speculative-decoding"]
    if kind == KIND_DRAFTER:
        tags += ["redrafter", "draft-model"]
    else:
        kinds = config.get("kinds") or []
        kinds = kinds.split(",") if isinstance(kinds, str) else list(kinds)
        tags += ["n-gram"]
        if {"unigram", "bigram", "extended"} & set(kinds):
            tags.append("n-grammys")
        if "trigram" in kinds:
            tags.append("aded")
    meta = {"library_name": "redraft"}
    if base:
        meta["base_model"] = base
    meta["tags"] = tags
    meta["license"] = license
    if datasets:
        meta["datasets"] = datasets
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).strip()

    target_text = f"[`{base}`](https://huggingface.co/{base})" if base else f"`{target or 'unknown'}`"
    out = [f"---\n{front}\n---", ""]
    if kind == KIND_DRAFTER:
        out += [f"# {name}: ReDrafter draft head for {target or 'its target'}", "",
                f"A [ReDrafter](https://arxiv.org/abs/2403.09919) draft head for speculative "
                f"decoding of {target_text}, trained with redraft. It is a "
                f"small recurrent head on the target's last hidden state; it reuses the target's "
                f"own (frozen) input embeddings, which are not stored here. The target verifies "
                f"every drafted token, so greedy decoding gives exactly the target's own output, "
                f"only in fewer target calls."]
    else:
        out += [f"# {name}: n-gram draft tables for {target or 'its target'}", "",
                f"Learning-free draft tables for speculative decoding of {target_text}, built with "
                f"redraft: model-derived unigram / bigram / extended tables "
                f"([N-Grammys](https://arxiv.org/abs/2411.03786)) computed from the target's own "
                f"weights, and corpus tri-gram tables ([ADED](https://arxiv.org/abs/2408.08696)). "
                f"The target verifies every drafted token, so its output does not change."]

    out += ["", "## Target model", ""]
    rows = [["model", target or "unknown"]]
    for key in ("target_vocab_size", "target_hidden_size", "tokenizer_fingerprint"):
        value = _find_key(config, (key,))
        if value is not None:
            rows.append([key, value])
    out += [_table(["field", "value"], rows), "",
            "redraft refuses to load this artifact with a target whose tokenizer fingerprint differs."]

    if kind == KIND_DRAFTER:
        arch = [[k, v] for k, v in config.items() if not k.startswith("_") and k not in _CONFIG_NOISE
                and not k.startswith("target_") and isinstance(v, (int, float, str, bool))]
        if arch:
            out += ["", "## Architecture", "", _table(["setting", "value"], arch)]
    else:
        settings = [[k, v] for k, v in config.items()
                    if isinstance(v, (int, float, str, bool, list)) and k not in _TARGET_KEYS
                    and k != "tokenizer_fingerprint" and not k.startswith("target_")
                    and not (isinstance(v, list) and len(v) > 16)]
        if settings:
            out += ["", "## Tables", "", _table(["setting", "value"], settings)]
        files = []
        for f in upload_files(root):
            if f.endswith(".safetensors"):
                header = _safetensors_header(root / f)
                for tname, t in header.items():
                    if tname != "__metadata__":
                        files.append([f, tname, "x".join(map(str, t["shape"])), t["dtype"]])
        if files:
            out += ["", _table(["file", "tensor", "shape", "dtype"], files)]

    out += ["", "## Training data" if kind == KIND_DRAFTER else "## Data", ""]
    if data_specs:
        specs = data_specs if isinstance(data_specs, list) else [data_specs]
        out += [f"- `{_fmt(s)}`" for s in specs]
        if datasets:
            out += ["", "Hub datasets: " + ", ".join(f"[{d}](https://huggingface.co/datasets/{d})"
                                                     for d in datasets)]
    elif kind == KIND_NGRAMS and "aded" not in tags:
        out.append("Model-derived tables use no data: they come from the target's weights alone.")
    else:
        out.append("Not recorded with this artifact.")

    if recipe:
        out += ["", "## Recipe", "", f"The resolved training configuration (`{recipe_name}`):", "",
                "```yaml", yaml.safe_dump(recipe, sort_keys=False).strip(), "```"]
    elif kind == KIND_NGRAMS and isinstance(config.get("build_args"), dict):
        out += ["", "## Recipe", "", "Build arguments:", "", "```yaml",
                yaml.safe_dump(config["build_args"], sort_keys=False).strip(), "```"]

    if metrics:
        out += ["", "## Held-out metrics", "", _metrics_section(metrics)]
    bench = _bench_section(root)
    if bench:
        out += ["", "## Benchmark", "", bench]

    fields = USAGE_FIELDS["drafter" if kind == KIND_DRAFTER else "ngrams"]
    kind_name = "drafter" if kind == KIND_DRAFTER else "ngrams"
    out += ["", "## Usage", "", USAGE.format(repo=repo_id or str(root), target=target or "TARGET",
                                             kind=kind_name, **fields)]
    return "\n".join(out).rstrip() + "\n"


def write_model_card(artifact_dir: str | os.PathLike, **kwargs) -> Path:
    """Write (atomically) the :func:`generate_model_card` card to ``artifact_dir/README.md``.

    The trainer and the n-gram builder call this when they finish; keyword arguments go to
    :func:`generate_model_card`. Returns the card's path.
    """
    path = Path(artifact_dir) / CARD_FILE
    atomic_write_text(path, generate_model_card(artifact_dir, **kwargs))
    return path


# --------------------------------------------------------------------------------------------
# Upload
# --------------------------------------------------------------------------------------------

# Seconds between attempts on a transient error (HTTP 429/5xx, connection drop): 4 retries.
RETRY_DELAYS = (2.0, 4.0, 8.0, 16.0)
_sleep = time.sleep  # tests replace this

# A repo holds one artifact: weights of an earlier push that this one does not re-upload (say,
# shards of a previously sharded head) are deleted in the same commit, so loaders never mix them.
STALE_PATTERNS = ("*.safetensors", "*.safetensors.index.json")


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _transient_types() -> tuple[type, ...]:
    types: list[type] = [ConnectionError, TimeoutError]
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests", ("ConnectionError", "Timeout"))):
        try:
            mod = __import__(module)
        except ImportError:
            continue
        types += [getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), type)]
    return tuple(types)


def is_transient(exc: BaseException) -> bool:
    """Whether an Hub call failure is worth retrying: HTTP 429 / 5xx, or the connection failed."""
    if type(exc).__name__ == "OfflineModeIsEnabled":  # a ConnectionError, but it never passes
        return False
    status = _status(exc)
    if status is not None:
        return status == 429 or status >= 500
    return isinstance(exc, _transient_types())


def _with_retries(step: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, retried after :data:`RETRY_DELAYS` on transient errors."""
    for attempt, delay in enumerate((*RETRY_DELAYS, None)):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if delay is None or not is_transient(exc):
                raise
            response = getattr(exc, "response", None)
            headers = getattr(response, "headers", None) if response is not None else None
            retry_after = headers.get("Retry-After") if headers is not None else None
            if retry_after and str(retry_after).isdigit():
                delay = max(delay, float(retry_after))
            logger.warning(
                "%s failed (%s); retry %d/%d in %.0f s", step, _first_line(exc), attempt + 1,
                len(RETRY_DELAYS), delay)
            _sleep(delay)


def _push_error(step: str, repo_id: str, exc: BaseException, root: Path) -> ArtifactError:
    status = _status(exc)
    if type(exc).__name__ == "OfflineModeIsEnabled":
        how = ("HF_HUB_OFFLINE is set, which blocks every Hub request: unset it "
               "(HF_HUB_OFFLINE=0) to push")
    elif status in (401, 403) or type(exc).__name__ in ("LocalTokenNotFoundError",):
        how = ("authentication failed: log in with `hf auth login`, set HF_TOKEN, or pass --token "
               "with a token that has write access to " + repo_id.split("/")[0])
    elif status == 404 or type(exc).__name__ == "RepositoryNotFoundError":
        how = f"the repo or namespace was not found: check {repo_id!r} and that you may write to it"
    elif is_transient(exc):
        how = (f"the Hub did not answer after {len(RETRY_DELAYS) + 1} attempts: check the network "
               f"(HF_ENDPOINT) and try again later")
    else:
        how = "the Hub refused it"
    return ArtifactError(f"Pushing {root} to {repo_id!r} failed at {step}: {how}. "
                         f"({_first_line(exc)}) Local files were not changed.")


def _stage(root: Path, files: list[str], card: str | None, stage: Path) -> None:
    """Lay out the upload in ``stage``: links to ``files`` (never copies of the weights) + card.

    A hard link pins the file as it is now (a later save into ``root`` replaces the name, not
    this inode); across filesystems, where hard links fail, a symlink to the resolved file.
    ``upload_folder`` reads through both. Nothing under ``root`` is written.
    """
    for rel in files:
        if card is not None and rel == CARD_FILE:
            continue
        src, dst = (root / rel).resolve(), stage / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            dst.symlink_to(src)
    if card is not None:
        (stage / CARD_FILE).write_text(card)


def push_artifact(artifact_dir: str | os.PathLike, repo_id: str, *, private: bool = False,
                  revision: str | None = None, token: str | None = None,
                  commit_message: str | None = None, license: str = "apache-2.0",
                  keep_card: bool = False, api=None) -> str:
    """Publish a finished artifact directory to the Hugging Face Hub.

    Checks the artifact is finished (:func:`check_finished`), renders a fresh model card
    (:func:`generate_model_card`; ``keep_card=True`` uploads the existing README.md as is),
    creates the repo if needed (and the branch ``revision``), and uploads the files of
    :func:`upload_files` (``training_state/`` and other resume-only files left out). The
    upload is staged in a temporary folder of links (:func:`_stage`), so the artifact directory
    is only written after the upload succeeded, and then only its README.md (atomically).
    Transient Hub errors are retried with backoff (:data:`RETRY_DELAYS`).

    Args:
        artifact_dir: the artifact directory.
        repo_id: ``org/name`` (or ``name`` under your user) on the Hub.
        private: create the repo private (an existing repo keeps its visibility).
        revision: branch to push to (created from main if missing); default main.
        token: a Hub token with write access; default the usual places (HF_TOKEN, hf auth login).
        commit_message: default "Upload redraft <kind> artifact".
        license: the model card's license metadata.
        keep_card: upload the directory's own README.md instead of generating one.
        api: an ``HfApi``-like object (tests); default ``HfApi(token=token)``.

    Returns:
        The URL of the uploaded revision on the Hub.

    Raises:
        ArtifactError: the artifact is not finished, or repo creation / branch creation /
            upload failed (the message says which and why); local files are then unchanged.
    """
    root = Path(artifact_dir)
    repo_id = str(repo_id)
    if "@" in repo_id:  # "org/name@branch" is accepted like everywhere else
        repo_id, at = split_revision(repo_id)
        if revision is not None and at is not None and at != revision:
            raise ArtifactError(f"Two revisions given: {at!r} in the repo id and {revision!r}.")
        revision = revision or at
    if not looks_like_repo_id(repo_id):
        raise ArtifactError(f"{repo_id!r} is not a Hub repo id; use 'org/name' (letters, digits, "
                            f"'-', '_', '.').")
    kind = check_finished(root)
    files = upload_files(root)
    if keep_card and CARD_FILE not in files:
        raise ArtifactError(f"--keep-card was given but {root / CARD_FILE} does not exist.")
    card = None if keep_card else generate_model_card(root, repo_id=repo_id, license=license)
    if api is None:
        if hub_offline():
            raise ArtifactError(f"Cannot push {root} to {repo_id!r}: HF_HUB_OFFLINE is set, which "
                                f"blocks every Hub request. Unset it (HF_HUB_OFFLINE=0) to push.")
        api = HfApi(token=token)

    try:
        repo_url = _with_retries("repo creation", api.create_repo, repo_id, private=private,
                                 exist_ok=True, repo_type="model")
    except Exception as exc:
        raise _push_error("repo creation", repo_id, exc, root) from exc
    if revision is not None and revision != "main":
        try:
            _with_retries("branch creation", api.create_branch, repo_id, branch=revision,
                          exist_ok=True, repo_type="model")
        except Exception as exc:
            raise _push_error(f"branch creation ({revision!r})", repo_id, exc, root) from exc

    stage = Path(tempfile.mkdtemp(prefix="redraft-push-"))
    try:
        _stage(root, files, card, stage)
        message = commit_message or f"Upload redraft {kind} artifact"
        try:
            _with_retries("upload", api.upload_folder, repo_id=repo_id, folder_path=str(stage),
                          commit_message=message, revision=revision, repo_type="model",
                          ignore_patterns=list(RESUME_ONLY_PATTERNS),
                          delete_patterns=list(STALE_PATTERNS))
        except Exception as exc:
            raise _push_error("upload", repo_id, exc, root) from exc
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    if card is not None:  # the published card, now also the local one
        atomic_write_text(root / CARD_FILE, card)

    base = str(repo_url).rstrip("/") if repo_url else f"{_endpoint()}/{repo_id}"
    return f"{base}/tree/{revision}" if revision else base


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def push_main(argv: list[str] | None = None) -> int:
    """``redraft-push DIR REPO_ID``: publish a finished drafter or n-gram artifact to the Hub."""
    parser = argparse.ArgumentParser(
        prog="redraft-push",
        description="Publish a finished redraft artifact (a ReDrafter head or n-gram tables) to the "
                    "Hugging Face Hub: generates the model card, creates the repo if needed and "
                    "uploads everything except resume-only training state.")
    parser.add_argument("artifact_dir", metavar="DIR",
                        help="the artifact directory (config.json + model.safetensors, or "
                             "ngrams.json + *.safetensors)")
    parser.add_argument("repo_id", metavar="REPO_ID",
                        help="the Hub repo to push to, 'org/name' (created if missing)")
    parser.add_argument("--private", action="store_true",
                        help="create the repo private (an existing repo keeps its visibility)")
    parser.add_argument("--revision", default=None,
                        help="branch to push to, created from main if missing (default: main)")
    parser.add_argument("--token", default=None,
                        help="Hub token with write access (default: HF_TOKEN or `hf auth login`)")
    parser.add_argument("--commit-message", default=None,
                        help="commit message (default: 'Upload redraft <kind> artifact')")
    parser.add_argument("--license", default="apache-2.0",
                        help="license id for the model card metadata (default: apache-2.0; use "
                             "the target model's license if it is stricter)")
    parser.add_argument("--keep-card", action="store_true",
                        help="upload DIR/README.md as it is instead of generating the model card")
    parser.add_argument("--print-card", action="store_true",
                        help="print the generated model card and exit without uploading")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.print_card:
            print(generate_model_card(args.artifact_dir, repo_id=args.repo_id, license=args.license),
                  end="")
            return 0
        url = push_artifact(args.artifact_dir, args.repo_id, private=args.private,
                            revision=args.revision, token=args.token,
                            commit_message=args.commit_message, license=args.license,
                            keep_card=args.keep_card)
    except RedraftError as exc:
        print(f"redraft-push: error: {exc}", file=sys.stderr)
        return 1
    print(f"Pushed {args.artifact_dir} to {url}")
    return 0
