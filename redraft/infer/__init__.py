"""The speculative decoder: drafters, tree building, verification, acceptance, KV cache.

Public API::

    from redraft.infer import SpeculativeDecoder, DecoderConfig, SamplingParams, load_decoder, plain_greedy
    from redraft.infer.drafters import Drafter, Draft, DecodeState, Feedback

``SpeculativeDecoder.generate``/``stream`` decode a prompt or a batch; ``decoder.engine()`` gives
the step-level engine (continuous batching: ``add``, ``step``, ``cancel``) the server runs.

Names are imported on first use (PEP 562), so ``import redraft.infer.config`` (what command-line
parsers need) does not load torch.
"""

import importlib

_WHERE = {
    "DecoderConfig": "config",
    "SamplingParams": "config",
    "SpeculativeDecoder": "decoder",
    "plain_greedy": "decoder",
    "Engine": "engine.engine",
    "load_decoder": "loader",
    "load_preset": "loader",
    "read_preset": "loader",
    "Generation": "stats",
    "RequestStats": "stats",
    "StreamEvent": "stats",
}

__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"redraft.infer.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'redraft.infer' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
