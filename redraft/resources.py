"""The files redraft ships besides its code, found the same way in every kind of install.

``redraft/configs/train/`` (DeepSpeed configs ``ds_zero{0,1,2,3}.json``, recipes
``recipes/*.yaml``) and ``redraft/configs/infer/`` (decoding presets, benchmark recipes) are
package data (pyproject.toml): a wheel holds them, an editable install reads the checkout's
files, and ``importlib.resources`` finds them under ``redraft/configs/`` either way. The
checkout's top-level ``train`` and ``infer`` are symlinks to them, so the paths the Makefile and
the docs spell (``infer/bench-default.yaml``) are files in a checkout too.

Outputs never go here: default output paths (``checkpoints/...``) are relative to the working
directory.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

from redraft.errors import ConfigError

STAGES = ("train", "infer")


def config_dir(stage: str) -> Path:
    """The shipped folder of ``stage`` (``"train"`` or ``"infer"``) as a filesystem path."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    path = files("redraft") / "configs" / stage
    if not isinstance(path, Path) or not path.is_dir():  # a zipped install, or a broken one
        raise ConfigError(
            f"redraft's {stage}/ files are missing from its installation ({path}); "
            f"reinstall redraft from a wheel or a checkout (pip install .)."
        )
    return path


def find_config(spec: str | os.PathLike, stage: str, suffix: str = ".yaml") -> Path:
    """A config file: ``spec`` itself when that file exists (relative to the working directory),
    else the shipped file of ``stage`` it names: ``NAME``, ``NAME.yaml`` or ``STAGE/NAME.yaml``
    (as the repository spells it), e.g. ``find_config("infer/bench-default.yaml", "infer")``.

    Raises:
        ConfigError: neither exists; the message lists the shipped names.
    """
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    root = config_dir(stage)
    name = path.as_posix().removeprefix("./").removeprefix(f"{stage}/")
    for cand in (root / name, root / f"{name}{suffix}"):
        if cand.is_file():
            return cand
    have = sorted(p.relative_to(root).as_posix() for p in root.rglob(f"*{suffix}"))
    raise ConfigError(
        f"{os.fspath(spec)!r} is neither an existing file nor one of the {stage} files "
        f"redraft ships ({', '.join(have)})."
    )
