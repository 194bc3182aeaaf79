"""Decoder settings and per-request sampling settings: one place for each default and check.

* :class:`DecoderConfig`: how the decoder drafts and verifies (acceptance rule, node budget,
  drafter settings). ``SpeculativeDecoder``, ``load_decoder``, ``make_drafters``, the YAML
  presets (``infer/decode-*.yaml``), ``redraft-bench`` and ``redraft-serve`` all read it; an
  unknown key is an error that names it.
* :class:`SamplingParams`: what one request asks for (``max_new_tokens``, ``temperature``,
  ``top_p``, ``stop``, ``seed``). :meth:`SamplingParams.checked` and :func:`check_prompt` are
  the only argument checks of the decoding API; the server reports their ``ConfigError.param``.

Nothing here imports torch, so command-line ``--help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from redraft.errors import ConfigError

ACCEPTANCE = ("greedy", "rejection", "typical")
TYPICAL_EPS = 0.3  # Medusa's typical-acceptance defaults
TYPICAL_DELTA = 0.09


def _f(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class DecoderConfig:
    """Every setting of the speculative decoder (each is a preset key and a ``redraft-bench`` flag)."""

    # ---- verification
    acceptance: str = _f("greedy", "'greedy' (output equals plain greedy decoding), 'rejection' (lossless "
                         "sampling; greedy at temperature 0) or 'typical' (Medusa's typical acceptance, not lossless).")
    budget: Any = _f("auto", "Tree nodes verified per step besides the root: 'auto' (chosen per step from the "
                     "measured verify-cost curve and the drafters' acceptance rates) or a number.")
    max_nodes: int = _f(64, "Upper bound on tree nodes per row and step for the 'auto' budget.")
    fp32_logits: bool = _f(False, "Compute verify logits with a float32 LM head (bf16 targets: fewer near-tie flips).")
    typical_eps: float = _f(TYPICAL_EPS, "Typical acceptance: probability threshold epsilon.")
    typical_delta: float = _f(TYPICAL_DELTA, "Typical acceptance: entropy-scaled threshold delta.")
    adapt: bool = _f(True, "Update per-drafter acceptance rates while decoding (they rank tree nodes).")
    gate: bool = _f(True, "With several drafters and the 'auto' budget, skip a drafter while the tokens only it "
                    "gets accepted are worth less than its drafting time (re-tried after growing waits).")
    gate_explore: int = _f(8, "Steps a skipped drafter waits before it is tried again (doubles while useless, "
                           "up to 16x).")
    guard: bool = _f(True, "With the 'auto' budget and a batch of 2 or more rows, time speculative and plain "
                     "steps per batch size and run plain steps where speculation is slower (re-tried "
                     "after growing waits): speculation never makes a loaded batch slower for long.")
    cpu_pack: bool = _f(True, "On CPU, faster weight layouts for multi-token verify forwards (oneDNN-packed float32 "
                        "linears, contiguous LM head); the model itself is not modified.")
    static_verify: Any = _f("auto", "Pad verify trees to a few fixed sizes and capture the forward in a CUDA graph: "
                            "'auto' (on for CUDA, off on CPU), true or false.")
    prefill_chunk: Any = _f("auto", "Prompt tokens prefilled per step while other requests decode (chunked prefill: "
                            "a long prompt joins over several steps, each one chunk's forward beside the running "
                            "rows' step): 'auto' (from the measured verify-cost curve: the largest chunk, a "
                            "multiple of 16 in [16, 2048], whose forward costs no more than the running rows' "
                            "last verify forward; 2048 while no row decodes), a number of tokens, or 0 (off: "
                            "every prompt in one forward).")
    # ---- drafters (load_decoder / make_drafters)
    redrafter_width: int = _f(8, "ReDrafter beams per step.")
    redrafter_length: int | None = _f(None, "ReDrafter tokens per beam (default: the head's training horizon).")
    ngram_k: int = _f(8, "N-gram draft rows per step (context matches, then model-bigram chains).")
    ngram_w: int = _f(12, "Tokens per n-gram draft row.")
    context_q: int = _f(1, "Shortest context match, in tokens.")
    context_q_max: int = _f(3, "Longest context match, tried first.")
    context: bool | None = _f(None, "Add a context n-gram drafter (default: only when no n-gram tables are "
                              "given; the N-Grammys drafter of each table already matches the context).")
    aded: bool = _f(False, "Also draft with ADED's MCTS over every n-gram table set that holds tri-grams.")

    def __post_init__(self):
        self.validate()

    def validate(self) -> "DecoderConfig":
        def bad(key, why):
            raise ConfigError(f"decoder setting {key}={getattr(self, key)!r}: {why}", param=key)

        def integer(key, low, high=None, optional=False):
            v = getattr(self, key)
            if v is None and optional:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
                bad(key, f"use an integer >= {low}" + (f" and <= {high}" if high is not None else "") + ".")

        if self.acceptance not in ACCEPTANCE:
            bad("acceptance", f"use one of {ACCEPTANCE}.")
        if isinstance(self.budget, str) and self.budget != "auto":
            try:
                self.budget = int(self.budget)
            except ValueError:
                bad("budget", "use 'auto' or a number of tree nodes >= 0.")
        if self.budget != "auto":
            integer("budget", 0)
        integer("max_nodes", 0, 4096)
        integer("gate_explore", 1)
        for key in ("typical_eps", "typical_delta"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1e6 or math.isnan(v):
                bad(key, "use a number > 0.")
        for key in ("fp32_logits", "adapt", "gate", "guard", "cpu_pack", "aded"):
            if not isinstance(getattr(self, key), bool):
                bad(key, "use true or false.")
        if self.context is not None and not isinstance(self.context, bool):
            bad("context", "use true, false or null.")
        if self.static_verify not in ("auto", True, False):
            bad("static_verify", "use 'auto', true or false.")
        if isinstance(self.prefill_chunk, str) and self.prefill_chunk != "auto":
            try:
                self.prefill_chunk = int(self.prefill_chunk)
            except ValueError:
                bad("prefill_chunk", "use 'auto', a number of tokens >= 1, or 0 (off).")
        if self.prefill_chunk != "auto":
            integer("prefill_chunk", 0)
        integer("redrafter_width", 1, 1024)
        integer("redrafter_length", 1, 256, optional=True)
        integer("ngram_k", 1, 1024)
        integer("ngram_w", 1, 1024)
        integer("context_q", 1, 64)
        integer("context_q_max", 1, 64)
        if self.context_q > self.context_q_max:
            raise ConfigError(f"decoder settings context_q={self.context_q} and context_q_max={self.context_q_max}: "
                              f"the shortest context match cannot be longer than the longest; use context_q <= "
                              f"context_q_max (raise context_q_max too).", param="context_q")
        return self

    def replace(self, **changes) -> "DecoderConfig":
        """A copy with ``changes`` applied (unknown keys are errors)."""
        return DecoderConfig.from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict, where: str = "the decoder settings") -> "DecoderConfig":
        """Build from a mapping (a preset, keyword arguments); unknown keys are errors naming them."""
        unknown = [k for k in values if k not in FIELDS]
        if unknown:
            k = unknown[0]
            close = difflib.get_close_matches(k, FIELDS, n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown decoder setting {k!r} in {where}.{hint} Known settings: "
                              f"{', '.join(sorted(FIELDS))}.", param=k)
        return cls(**values)

    @staticmethod
    def help(key: str) -> str:
        return FIELDS[key].metadata["help"]


FIELDS = {f.name: f for f in fields(DecoderConfig)}


# ------------------------------------------------------------------------------ per request


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for. Build it with :meth:`checked` (what the API and server do),
    which normalises and validates every field, naming the field in the error.

    Attributes:
        max_new_tokens: new tokens at most (>= 1).
        temperature: 0 for greedy; > 0 samples (the decoder's acceptance must then be
            "rejection", lossless, or "typical").
        top_p: nucleus threshold in (0, 1] (with temperature > 0).
        stop: strings that end the request; the text is cut before the first one.
        seed: seeds this request's own sampling generator (``None``: the decoder's shared one).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    @classmethod
    def checked(cls, max_new_tokens: Any = 128, temperature: Any = 0.0, top_p: Any = 1.0,
                stop: str | Sequence[str] | None = None, seed: Any = None) -> "SamplingParams":
        def bad(param, value, why):
            raise ConfigError(f"{param}={value!r}: {why}", param=param)

        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            bad("max_new_tokens", max_new_tokens, "use an integer >= 1.")
        for name, v in (("temperature", temperature), ("top_p", top_p)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, v, "use a finite number.")
        if temperature < 0:
            bad("temperature", temperature, "use 0 (greedy) or a positive number.")
        if not 0 < top_p <= 1:
            bad("top_p", top_p, "use a number in (0, 1].")
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)  # one stop string, not a list of characters
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
        else:
            bad("stop", stop, "use a string or a list of strings.")
        for s in stop:
            if not isinstance(s, str) or not s:
                bad("stop", list(stop), "every stop string must be a non-empty string.")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63):
            bad("seed", seed, "use an integer in [0, 2**63) or none.")
        return cls(int(max_new_tokens), float(temperature), float(top_p), stop, seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def check_prompt(ids: Any, vocab_size: int, context_length: int | None, max_new_tokens: int,
                 index: int | None = None) -> list[int]:
    """A prompt's token ids as a list of ints, checked: non-empty, every id in ``[0, vocab_size)``,
    and prompt + ``max_new_tokens`` within the model's context (when it has a known one)."""
    where = "prompt" if index is None else f"prompt {index}"
    if not isinstance(ids, list) or not ids:
        raise ConfigError(f"{where} is empty; give at least one token.", param="prompt")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(f"{where} holds token id {bad[0]!r}, outside the vocabulary [0, {vocab_size}).",
                          param="prompt")
    if context_length:
        if len(ids) >= context_length:
            raise ConfigError(f"{where} has {len(ids)} tokens; the model's context is {context_length} tokens. "
                              f"Shorten the prompt.", param="prompt")
        if len(ids) + max_new_tokens > context_length:
            raise ConfigError(f"{where} has {len(ids)} tokens and max_new_tokens is {max_new_tokens}: together "
                              f"they exceed the model's context of {context_length} tokens; use max_new_tokens "
                              f"<= {context_length - len(ids)}.", param="max_new_tokens")
    return ids
