"""The host side of a decode step: requests' rows and the one readout.

* :class:`Row`: one request on the host: its tokens (prompt + output, in a growing numpy buffer),
  sampling settings, text stream and stats;
* :class:`StepReadout`: the step's one device-to-host transfer.

What host drafters draft from (``HostState``) is part of the drafter interface
(:mod:`redraft.infer.spec.drafter`); step timestamps are the runner's (``runner.clock.Clock``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from redraft.errors import ConfigError
from redraft.infer.config import SamplingParams
from redraft.infer.engine.text import NoText, TextStream
from redraft.infer.stats import RequestStats


@dataclass
class Row:
    """Host-side record of one request: its tokens (prompt + output, the last one is the token
    the target produced last, not yet in the cache) in a growing numpy buffer."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    text: TextStream | NoText
    uniforms: torch.Tensor | None = (
        None  # a seeded request's own random numbers, one per output token
    )
    tokens: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    seq: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    length: int = 0  # valid entries of seq (prompt + output so far)
    filled: int = 0  # prompt tokens in the cache while the row is being prefilled (chunked prefill)
    slot: int | None = None  # its cache slot while its prompt is prefilled in several pieces
    reused: list | None = None  # prefix cache blocks of its first `filled` tokens, to copy in
    logprobs: list = field(default_factory=list)  # TokenLogprob per kept token, when asked for
    done: bool = False
    t_start: float = 0.0

    def append(self, toks) -> None:
        """Add tokens to the row's sequence (the buffer doubles when full)."""
        n = len(toks)
        if self.length + n > len(self.seq):
            grown = np.zeros(max(2 * len(self.seq), self.length + n + 64), np.int64)
            grown[: self.length] = self.seq[: self.length]
            self.seq = grown
        self.seq[self.length : self.length + n] = toks
        self.length += n

    @property
    def last(self) -> int:
        return int(self.seq[self.length - 1])

    def take(self, toks: list[int], eos: set) -> tuple[list[int], str, str | None]:
        """Append a step's tokens: ``(tokens kept, text delta, finish reason or None)``."""
        if len(self.tokens) < self.params.min_tokens:
            eos = set()  # masked by the processors until then: a draft cannot end the row either
        new, reason = [], None
        for t in toks:
            if len(self.tokens) >= self.params.max_new_tokens:
                break
            self.tokens.append(t)
            new.append(t)
            if t in eos:
                reason = "eos"
                break
            if (
                t in self.params.stop_token_ids
            ):  # kept in the tokens, its text left out (as vLLM does)
                reason = "stop"
                break
        if reason is None and len(self.tokens) >= self.params.max_new_tokens:
            reason = "length"
        text = self.text.add(new[:-1] if reason == "stop" else new)
        if self.text.stopped:
            reason = "stop"
        if reason:
            text += self.text.finish()
        self.stats.new_tokens = len(self.tokens)
        return new, text, reason


class StepReadout:
    """The step's one device-to-host transfer: ``choices`` ``[R, B, N]`` (R rules' picks per
    node, see ``SpeculativeDecoder.choices``) as numpy; ``logprobs`` (``accept.logprob_table``,
    a second read only when a row asked for log-probabilities) too."""

    def __init__(self, choices: torch.Tensor, logprobs: torch.Tensor | None = None):
        self.values = choices.cpu().numpy() if choices.device.type != "cpu" else choices.numpy()
        self.logprobs = None if logprobs is None else logprobs.float().cpu().numpy()


def sampling_params_of(params) -> SamplingParams:
    """``SamplingParams``, or a dict of its fields (checked), or None (the defaults)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, dict):
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        if unknown := sorted(set(params) - known):
            raise ConfigError(
                f"unknown sampling parameter(s) {unknown}; use {sorted(known)}.", param=unknown[0]
            )
        return SamplingParams.checked(**params)
    if not hasattr(params, "max_new_tokens"):
        raise ConfigError(
            f"params must be a SamplingParams or a dict of its fields, not {type(params).__name__}.",
            param="params",
        )
    return params
