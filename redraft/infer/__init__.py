"""The speculative decoder: drafters, tree building, verification, acceptance, KV cache.

Public API::

    from redraft.infer import SpeculativeDecoder, load_decoder, plain_greedy
    from redraft.infer.drafters import Drafter, Draft, DecodeState, Feedback
"""

from redraft.infer.decoder import Generation, RequestStats, SpeculativeDecoder, StreamEvent, plain_greedy
from redraft.infer.loader import load_decoder, load_preset

__all__ = ["Generation", "RequestStats", "SpeculativeDecoder", "StreamEvent", "load_decoder", "load_preset", "plain_greedy"]
