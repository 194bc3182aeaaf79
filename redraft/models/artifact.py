"""The checks every drafter artifact passes on load, whatever its layout (redraft's or Apple's).

A drafter loads exactly or fails with an :class:`~redraft.errors.ArtifactError` that names the
file and the key at fault (a head with missing layers must never load with random ones):

* ``config.json`` is a JSON object (its values' types are checked by the config class);
* every weights file is a complete safetensors file;
* the tensor names are exactly the ones the config implies: none missing, none unexpected;
* every tensor has the shape the config implies;
* the weights' sha256 matches the one recorded in ``config.json`` at write time
  (``weights_sha256: {file name: hex}``); an artifact without one (written before redraft
  recorded it, or by another tool) loads with a warning, since corruption cannot be detected;
* every floating-point weight is finite.

transformers' own ``from_pretrained`` initialises missing tensors randomly and only reports it
in its load report, which is how a head with a layer missing used to decode garbage.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from redraft.errors import ArtifactError
from redraft.utils import atomic_write_text, sha256_file

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
SHA_KEY = "weights_sha256"  # in config.json: {weights file name: hex sha256}


def read_config_json(directory: Path) -> dict:
    """The parsed ``config.json`` of an artifact directory (a dict), or an ArtifactError."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ArtifactError(
            f"{directory} holds no {CONFIG_NAME}; it is not a drafter artifact (redraft-train "
            f"writes config.json + model.safetensors)."
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(
            f"{path} is not valid JSON ({exc}); restore it from the run that wrote it."
        ) from exc
    if not isinstance(data, dict):
        raise ArtifactError(
            f"{path} holds a JSON {type(data).__name__}, not an object with the drafter's settings."
        )
    return data


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of an artifact: ``model.safetensors``, or every shard that
    ``model.safetensors.index.json`` names. ArtifactError when none is there."""
    directory = Path(directory)
    index = directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (
            UnicodeDecodeError,
            json.JSONDecodeError,
            KeyError,
            TypeError,
            AttributeError,
        ) as exc:
            raise ArtifactError(
                f"{index} is not a safetensors index (a JSON object with a weight_map): {exc}"
            ) from exc
        files = [directory / n for n in names]
    else:
        files = [directory / WEIGHTS_NAME]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ArtifactError(
            f"{directory} lacks its weights {', '.join(missing)}: the artifact is incomplete "
            f"(copy or download it again, or re-run the training or export that wrote it)."
        )
    return files


def tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except Exception as exc:  # SafetensorError (truncated, bad header), OSError
            raise ArtifactError(
                f"{path} is not a complete safetensors file ({exc}): it was cut off or damaged; "
                f"copy or download it again, or re-run what wrote it."
            ) from exc
    return shapes


def check_tensor_layout(
    found: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    where: Path,
    implied_by: str,
) -> None:
    """ArtifactError unless ``found`` has exactly the names and shapes of ``expected``.

    ``implied_by`` names the config values the expectation comes from (shown in the message).
    """
    missing = [k for k in expected if k not in found]
    unexpected = sorted(k for k in found if k not in expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors {', '.join(unexpected)}")
        raise ArtifactError(
            f"{where}: {'; '.join(parts)} for the config ({implied_by}). The weights and "
            f"config.json belong to different heads or the file is incomplete: use the "
            f"directory exactly as it was written."
        )
    for key, shape in expected.items():
        if tuple(found[key]) != tuple(shape):
            raise ArtifactError(
                f"{where}: tensor {key} has shape {list(found[key])}, but the config "
                f"({implied_by}) needs {list(shape)}. The weights and config.json belong "
                f"to different heads: use the directory exactly as it was written."
            )


def verify_sha256(directory: Path, config: dict, files: list[Path]) -> None:
    """Check each weights file against ``config[SHA_KEY]``; warn when nothing is recorded."""
    where = Path(directory) / CONFIG_NAME
    recorded = config.get(SHA_KEY)
    if recorded is None:
        warnings.warn(
            f"{where} records no {SHA_KEY} (written by an older redraft or another tool), so a "
            f"corrupted weights file cannot be detected; save the head again with "
            f"save_pretrained (or redraft-export) to record it.",
            UserWarning,
            stacklevel=3,
        )
        return
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        raise ArtifactError(
            f"{where}: {SHA_KEY} must map each weights file name to its hex sha256, "
            f"got {recorded!r}."
        )
    for path in files:
        want = recorded.get(path.name)
        if want is None:
            raise ArtifactError(
                f"{where} records no sha256 for {path.name} (it names {sorted(recorded)}); "
                f"the weights file does not belong to this config."
            )
        got = sha256_file(path)
        if got != want:
            raise ArtifactError(
                f"{path} does not match the sha256 recorded in {where} (recorded {want[:16]}..., "
                f"file {got[:16]}...): it changed after it was written (corrupted, cut off "
                f"or edited). Copy or download it again, or re-run what wrote it."
            )


def record_sha256(directory: Path, files: list[Path] | None = None) -> dict:
    """Write ``SHA_KEY`` (the sha256 of each weights file) into ``directory/config.json``
    (atomically) and return it. ``files`` defaults to :func:`weight_files`."""
    directory = Path(directory)
    files = weight_files(directory) if files is None else files
    shas = {p.name: sha256_file(p) for p in files}
    config = read_config_json(directory)
    config[SHA_KEY] = shas
    atomic_write_text(directory / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
    return shas


def check_finite(state: dict, where: str | os.PathLike) -> None:
    """ArtifactError naming the first floating-point tensor of ``state`` (name -> tensor) that
    holds NaN or inf."""
    import torch

    for key, t in state.items():
        if t.is_floating_point() and t.device.type != "meta":
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise ArtifactError(
                    f"{where}: tensor {key} holds {bad} non-finite values (NaN or inf) of "
                    f"{t.numel()}; the training diverged or the file is damaged. Retrain "
                    f"(a lower --lr, --grad-clip) or restore the file."
                )
