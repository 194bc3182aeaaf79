"""Target loading and the ReDrafter draft head."""

from redraft.models.redrafter import ReDrafter, ReDrafterConfig, load_drafter
from redraft.models.target import (
    DEFAULT_MODEL_ID,
    DEFAULT_SPEC,
    Target,
    check_fingerprint,
    load_target,
    tokenizer_fingerprint,
)

__all__ = [
    "DEFAULT_MODEL_ID",
    "DEFAULT_SPEC",
    "ReDrafter",
    "ReDrafterConfig",
    "Target",
    "check_fingerprint",
    "load_drafter",
    "load_target",
    "tokenizer_fingerprint",
]
