"""Drafters: everything that proposes candidate token paths to the speculative decoder."""

from redraft.infer.drafters.base import PAD, DecodeState, Draft, Drafter, Feedback

__all__ = ["PAD", "DecodeState", "Draft", "Drafter", "Feedback"]
