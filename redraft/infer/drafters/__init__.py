"""Drafters: everything that proposes candidate token paths to the speculative decoder."""

from redraft.infer.spec.drafter import DecodeState, Draft, Drafter, Feedback
from redraft.infer.spec.paths import PAD

__all__ = ["PAD", "DecodeState", "Draft", "Drafter", "Feedback"]
