"""Drafters: everything that proposes candidate token paths to the speculative decoder.

The interface (:mod:`redraft.infer.spec.drafter`): :class:`Drafter` drafts on the device,
:class:`HostDrafter` on the host; both return a :class:`Draft`. The families: ``ngram``
(context matches, model tables, N-Grammys), ``aded/``, ``hsddw/``, ``redrafter/``,
``retrieval``.
"""

from redraft.infer.spec.drafter import (
    DecodeState,
    Draft,
    Drafter,
    Feedback,
    HostDrafter,
    HostFeedback,
    HostState,
)
from redraft.infer.spec.paths import PAD

__all__ = [
    "PAD",
    "DecodeState",
    "Draft",
    "Drafter",
    "Feedback",
    "HostDrafter",
    "HostFeedback",
    "HostState",
]
