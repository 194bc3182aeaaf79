"""Target loading and the ReDrafter draft head.

The names below are imported on first use (PEP 562), so ``import redraft.models`` (and the
command-line tools' ``--help``) does not load torch and transformers.
"""

import importlib

_EXPORTS = {
    "DEFAULT_MODEL_ID": "redraft.models.target",
    "DEFAULT_SPEC": "redraft.models.target",
    "Target": "redraft.models.target",
    "check_fingerprint": "redraft.models.target",
    "load_target": "redraft.models.target",
    "tokenizer_fingerprint": "redraft.models.target",
    "ReDrafter": "redraft.models.redrafter",
    "ReDrafterConfig": "redraft.models.redrafter",
    "ReDrafterOutput": "redraft.models.redrafter",
    "load_drafter": "redraft.models.drafter_io",
    "read_drafter": "redraft.models.drafter_io",
    "drafter_loss": "redraft.models.losses",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
