"""The speculative decoder: drafters, tree building, verification, acceptance, KV cache.

Public API::

    from redraft.infer import SpeculativeDecoder, DecoderConfig, SamplingParams, load_decoder, plain_greedy
    from redraft.infer.drafters import Drafter, Draft, DecodeState, Feedback

``SpeculativeDecoder.generate``/``stream`` decode a prompt or a batch; ``decoder.engine()`` gives
the step-level engine (continuous batching: ``add``, ``step``, ``cancel``) the server runs.
"""

from redraft.infer.config import DecoderConfig, SamplingParams
from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.engine import Engine
from redraft.infer.loader import load_decoder, load_preset, read_preset
from redraft.infer.stats import Generation, RequestStats, StreamEvent

__all__ = ["DecoderConfig", "Engine", "Generation", "RequestStats", "SamplingParams", "SpeculativeDecoder",
           "StreamEvent", "load_decoder", "load_preset", "plain_greedy", "read_preset"]
