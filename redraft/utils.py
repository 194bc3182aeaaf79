"""Small helpers every stage shares: one place for each.

* :func:`resolve_dtype` / :func:`resolve_device`: a torch dtype or device from what a user typed,
  with an error that lists the valid names (and says when CUDA is missing);
* :func:`split_revision`: ``"org/name@rev"`` -> ``("org/name", "rev")`` (hub ids and targets);
* :func:`atomic_write_text`, :func:`atomic_write_bytes`, :func:`atomic_path`: write a file so
  that readers see the old content or the new one, never half of it (a temporary file in the
  same directory, then ``os.replace``);
* :func:`sha256_file`: the hex sha256 of a file, read in blocks (artifacts record it at write time
  and check it on load).
* :class:`HelpFormatter`: command-line help that prints each default once;
* :class:`ArgumentParser`: argparse with one-line errors (exit 2, no usage dump), for every CLI.

Nothing here imports torch at module import, so command-line ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from redraft.errors import ConfigError

DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def resolve_dtype(dtype, device=None, error: type[Exception] = ConfigError):
    """A ``torch.dtype`` from a dtype, its name (``"bfloat16"``, ``"bf16"``, ``"float32"``...) or
    ``None`` (the default for ``device``: bfloat16 on CUDA, float32 elsewhere)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        return torch.bfloat16 if dev.type == "cuda" else torch.float32
    name = DTYPE_NAMES.get(str(dtype).removeprefix("torch."))
    if name is None:
        raise error(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_NAMES)}.")
    return getattr(torch, name)


def resolve_device(device=None, error: type[Exception] = ConfigError):
    """A ``torch.device`` from a device, its name or ``None`` (CUDA when available, else CPU).

    Checked before any work starts: ``cuda`` on a torch build or machine without CUDA is an
    error that says so, instead of a traceback from deep inside the first kernel.
    """
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise error(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'.") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch build has no CUDA"
                if torch.version.cuda is None
                else "no CUDA device is visible"
            )
            raise error(
                f"device {device!r} was asked for but {why}; use --device cpu (or install a CUDA "
                f"build of torch on a machine with a GPU)."
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise error(
                f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible."
            )
    elif dev.type not in ("cpu", "mps", "xpu", "meta"):
        raise error(f"device {device!r} is not supported; use 'cpu' or 'cuda'.")
    return dev


def split_revision(spec: str) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; no ``@`` (or an existing local path that
    contains one) -> ``(spec, None)``. Repo ids cannot contain ``@``, so the first one splits."""
    spec = str(spec)
    if "@" not in spec or os.path.exists(spec):
        return spec, None
    repo, _, rev = spec.partition("@")
    return repo, rev or None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path`` atomically, on
    any error (or Ctrl-C) it is removed and ``path`` is untouched.

    ``mode``: permissions of the new file (default: what the umask gives a new file; mkstemp
    alone would create 0600, which is wrong for artifacts meant to be shared).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_path`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: str | os.PathLike, block: int = 1 << 22) -> str:
    """Hex sha256 of the file at ``path``, read in ``block``-byte pieces (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(block), b""):
            h.update(piece)
    return h.hexdigest()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``argparse`` help with each default printed once, as ``(default: X)``, and none where the
    default is ``None`` or a ``store_true`` flag's ``False`` (the help text says what leaving the
    flag out means); ``--x/--no-x`` flags say which side is the default."""

    def _get_help_string(self, action):
        bare_switch = action.default is False and not isinstance(
            action, argparse.BooleanOptionalAction
        )
        if action.default is None or bare_switch:
            return action.help or ""
        return super()._get_help_string(action)


# extra -> what it installs beyond the core that decodes (pyproject.toml's optional-dependencies)
EXTRAS = {
    "train": ("deepspeed", "datasets", "tensorboard"),
    "serve": ("fastapi", "uvicorn", "prometheus_client"),
}


def require_extra(extra: str, *modules: str, what: str) -> None:
    """Raise a one-line ConfigError naming ``pip install 'redraft[extra]'`` when one of
    ``modules`` (import names; all of the extra's by default) is not installed: ``what`` (a
    command, a data source) needs it. Nothing is imported."""
    import importlib.util

    missing = [m for m in modules or EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"{what} needs {', '.join(missing)}, which redraft's {extra!r} extra installs: "
            f"pip install 'redraft[{extra}]'."
        )


_SUBCOMMAND: list[str] = []  # the command `redraft <command>` runs now (redraft.commands)


@contextlib.contextmanager
def subcommand(name: str):
    """While this block runs console script ``redraft-<name>``'s main as ``redraft <name>``, its
    parsers and errors call it so (:func:`command_name`)."""
    _SUBCOMMAND.append(name)
    try:
        yield
    finally:
        _SUBCOMMAND.pop()


def command_name(prog: str) -> str:
    """``prog`` as the user typed it: ``redraft-bench`` (or ``redraft-bench ...``, a parser of
    its subcommand) is ``redraft bench`` inside :func:`subcommand` ``("bench")``."""
    if _SUBCOMMAND:
        script = f"redraft-{_SUBCOMMAND[-1]}"
        if prog == script or prog.startswith(script + " "):
            return "redraft " + prog.removeprefix("redraft-")
    return prog


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (``prog: error: ...``), exit status 2, no usage dump: what
    every redraft command line uses, so a mistyped flag reads like any other redraft error. Its
    ``prog`` is the name the command was typed as (:func:`command_name`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prog = command_name(self.prog)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@functools.cache
def _forward_takes_cache(forward) -> bool:
    import inspect

    return "cache" in inspect.signature(forward).parameters


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` for passing a KV cache to ``model``'s forward under the name its
    transformers version takes: ``cache`` (the newer name; transformers 5.24 warns that
    ``past_key_values`` goes away in 5.40) or ``past_key_values`` (older 5.x releases, which
    pyproject's lower bound still allows). The signature is read once per forward function."""
    return {"cache" if _forward_takes_cache(type(model).forward) else "past_key_values": cache}
