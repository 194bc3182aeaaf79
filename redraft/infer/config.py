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

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

from redraft.errors import ConfigError
from redraft.settings import Range, Settings, setting

ACCEPTANCE = ("greedy", "rejection", "typical")
TYPICAL_EPS = 0.3  # Medusa's typical-acceptance defaults
TYPICAL_DELTA = 0.09


_f = setting  # one line per field: name, default, help and its range or choices


@dataclass
class DecoderConfig(Settings):
    """Every setting of the speculative decoder (each is a preset key and a ``redraft-bench`` flag)."""

    KIND = "decoder setting"

    # ---- verification
    acceptance: str = _f(
        "greedy",
        "'greedy' (output equals plain greedy decoding), 'rejection' (lossless "
        "sampling; greedy at temperature 0) or 'typical' (Medusa's typical acceptance, not lossless).",
        choices=ACCEPTANCE,
    )
    budget: Literal["auto"] | int = _f(
        "auto",
        "Tree nodes verified per step besides the root: 'auto' (chosen per step from the "
        "measured verify-cost curve and the drafters' acceptance rates) or a number.",
        range=Range(0),
    )
    max_nodes: int = _f(
        64,
        "Upper bound on tree nodes per row and step for the 'auto' budget.",
        range=Range(0, 4096),
    )
    fp32_logits: bool = _f(
        False, "Compute verify logits with a float32 LM head (bf16 targets: fewer near-tie flips)."
    )
    typical_eps: float = _f(
        TYPICAL_EPS,
        "Typical acceptance: probability threshold epsilon.",
        range=Range(0, 1e6, lo_open=True),
    )
    typical_delta: float = _f(
        TYPICAL_DELTA,
        "Typical acceptance: entropy-scaled threshold delta.",
        range=Range(0, 1e6, lo_open=True),
    )
    adapt: bool = _f(
        True, "Update per-drafter acceptance rates while decoding (they rank tree nodes)."
    )
    gate: bool = _f(
        True,
        "With several drafters and the 'auto' budget, skip a drafter while the tokens only it "
        "gets accepted are worth less than its drafting time (re-tried after growing waits).",
    )
    gate_explore: int = _f(
        8,
        "Steps a skipped drafter waits before it is tried again (doubles while useless, "
        "up to 16x).",
        range=Range(1),
    )
    guard: bool = _f(
        True,
        "With the 'auto' budget and a batch of 2 or more rows, time speculative and plain "
        "steps per batch size and run plain steps where speculation is slower (re-tried "
        "after growing waits): speculation never makes a loaded batch slower for long.",
    )
    cpu_pack: bool = _f(
        True,
        "On CPU, faster weight layouts for multi-token verify forwards (oneDNN-packed float32 "
        "linears, contiguous LM head); the model itself is not modified.",
    )
    lean_walk: bool = _f(
        True,
        "On CPU in float32, run Llama-family targets' forwards as a walk over their layers "
        "without transformers' module calls: the same kernels and numbers, less Python per "
        "step (redraft/models/lean.py); false: transformers' forward.",
    )
    compiled_attention: bool = _f(
        True,
        "On CPU in float32, forwards of one token per row (plain decoding steps), and of up to "
        "4 tokens a row at 2 rows or more, attend with a compiled loop over each row's own "
        "cached columns instead of SDPA over the longest row "
        "(redraft/infer/runner/tree_attention.py): float32 rounding apart, the same attention; "
        "false: SDPA.",
    )
    static_verify: Literal["auto"] | bool = _f(
        "auto",
        "Pad verify trees to a few fixed sizes and capture the forward in a CUDA graph: "
        "'auto' (on for CUDA, off on CPU), true or false.",
    )
    span_buckets: Literal["auto"] | bool = _f(
        "auto",
        "With static_verify: a captured verify attends over the shortest power-of-two span "
        "(at least 256 columns) that holds the longest row, one graph per span, instead of "
        "the cache's whole capacity (fewer keys read when a cache grown for long prompts "
        "holds short rows; more captures): 'auto' (on wherever static_verify is: "
        "several times cheaper steps for many rows in a long cache), true or false.",
    )
    prefill_chunk: Literal["auto"] | int = _f(
        "auto",
        "Prompt tokens prefilled per step while other requests decode (chunked prefill: "
        "a long prompt joins over several steps, each one piece's forward beside the running "
        "rows' step, shortest prompt first): 'auto' (each piece predicted from the measured "
        "cost of the pieces before it to cost at most --prefill-share decode steps; while no "
        "row decodes, every waiting prompt at once), a number of tokens, or 0 (off: every "
        "prompt in one forward).",
        range=Range(0),
    )
    prefill_share: float = _f(
        1.0,
        "With prefill_chunk 'auto': decode steps one prefill piece may cost while rows decode. "
        "Higher: a long prompt's first token sooner, the running streams' gaps longer (a "
        "step with a piece takes about 1 + this many steps; vLLM's max_num_batched_tokens "
        "trades the same two).",
        range=Range(0, 100, lo_open=True),
    )
    fuse_prefill: Literal["auto"] | bool = _f(
        "auto",
        "Run a prefill piece in the same forward as the running rows' verify (one weight pass "
        "for both, as vLLM and SGLang batch them) instead of a forward of its own: 'auto' (on "
        "wherever verifies are eager, e.g. on a CPU, where a forward's fixed cost is reading "
        "every weight; off where they replay CUDA graphs), true (wherever it can run) or false.",
    )
    prefix_cache: int = _f(
        8192,
        "Prompt tokens whose KV entries finished requests leave for later requests that start "
        "with the same tokens (a system prompt, a document, an earlier turn, a repeated "
        "question): their prefill is a copy. Blocks of 16 tokens, least recently used first "
        "out; each token takes layers x 2 x kv_heads x head_dim x dtype bytes (the default "
        "target in float32: 46 KB). 0: off.",
        range=Range(0, 10**9),
    )
    # ---- drafters (load_decoder / make_drafters)
    redrafter_width: Literal["auto"] | int = _f(
        "auto",
        "ReDrafter beams per step: 'auto' (chosen every few steps from the measured "
        "beam-search and verify costs and the observed acceptance by beam rank and depth, "
        "among 1-16; needs the 'auto' budget, else 8) or a number.",
        range=Range(1, 1024),
    )
    redrafter_length: Literal["auto"] | int | None = _f(
        "auto",
        "ReDrafter tokens per beam: 'auto' (chosen with the width, between 1 and the head's "
        "training horizon; needs the 'auto' budget, else the horizon), a number, or none (the "
        "head's training horizon).",
        range=Range(1, 256),
    )
    ngram_k: int = _f(
        8,
        "N-gram draft rows per step (context matches, then model-bigram chains).",
        range=Range(1, 1024),
    )
    ngram_w: int = _f(12, "Tokens per n-gram draft row.", range=Range(1, 1024))
    context_q: int = _f(1, "Shortest context match, in tokens.", range=Range(1, 64))
    context_q_max: int = _f(3, "Longest context match, tried first.", range=Range(1, 64))
    context: bool | None = _f(
        None,
        "Add a context n-gram drafter (default: only when no n-gram tables are "
        "given; the N-Grammys drafter of each table already matches the context).",
    )
    aded: bool = _f(
        False, "Also draft with ADED's MCTS over every n-gram table set that holds tri-grams."
    )
    suffix: bool = _f(
        False,
        "Also draft with SuffixDecoding's suffix trees (arctic-inference): one over each "
        "request's prompt and output, one over the outputs of earlier requests, kept as long as "
        "the decoder or server runs (repeated prompts, shared code and phrasing draft from what "
        "was already written).",
    )
    suffix_w: int = _f(
        32,
        "Suffix drafter: tokens per draft path at most (a long match earns a long draft, "
        "suffix_factor tokens per matched token; the trees are twice as deep, so a match this "
        "long can draft this many).",
        range=Range(1, 1024),
    )
    suffix_factor: float = _f(
        1.0,
        "Suffix drafter: draft tokens per matched token at most (SuffixDecoding's max_spec_factor: "
        "a match of m tokens drafts up to factor * m, never past suffix_w).",
        range=Range(0, 64, lo_open=True),
    )
    suffix_tokens: int = _f(
        1_000_000,
        "Suffix drafter: output tokens of earlier requests its global tree holds (about 250 bytes "
        "each at most); the oldest requests leave first. 0: each request drafts from itself only.",
        range=Range(0, 10**10),
    )

    def __post_init__(self):
        self.validate()

    @classmethod
    def subject(cls, key: str, value) -> str:
        return f"decoder setting {key}={value!r}"  # the Python API's and the presets' name of it

    def check(self) -> None:
        """What the schema's types and ranges cannot say: the shortest context match is not
        longer than the longest. (The tri-state fields, ``Literal["auto"] | bool`` or ``| int``,
        are read and checked by the schema: ``"12"`` is 12, ``"true"`` True.)"""
        if self.context_q > self.context_q_max:
            raise ConfigError(
                f"decoder settings context_q={self.context_q} and context_q_max={self.context_q_max}: "
                f"the shortest context match cannot be longer than the longest; use context_q <= "
                f"context_q_max (raise context_q_max too).",
                param="context_q",
            )


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
        stop_token_ids: token ids that end the request (finish reason "stop"; the token is kept
            in ``tokens``, its text left out of ``text``).
        presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logit of every
            token the output holds, once (presence) or once per occurrence (frequency).
        repetition_penalty: > 0; the logit of every token in the prompt or the output is
            divided by it when positive, multiplied when negative (1: off).
        logit_bias: ``((token id, bias), ...)`` added to those logits (bias in [-100, 100]).
        min_tokens: the end-of-sequence and ``stop_token_ids`` tokens are impossible before
            this many output tokens.
        min_p: in [0, 1]; drop tokens less likely than ``min_p`` times the likeliest one.
        top_k: keep the ``top_k`` likeliest tokens (0: all).
        logprobs: ``None``, or return the log-probability of every output token and of its
            ``logprobs`` likeliest alternatives (0 to 20).

    Penalties, bias and ``min_tokens`` change the logits (greedy rows too); then come the
    temperature, ``min_p``, ``top_k`` and ``top_p`` (sampled rows). Under speculation every
    tree node sees the counts of the output so far plus its own ancestors, so the output is
    exactly what plain decoding with the same settings gives (``redraft.infer.engine.processors``).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float = 0.0
    top_k: int = 0
    logprobs: int | None = None

    @classmethod
    def checked(
        cls,
        max_new_tokens: Any = 128,
        temperature: Any = 0.0,
        top_p: Any = 1.0,
        stop: str | Sequence[str] | None = None,
        seed: Any = None,
        stop_token_ids: Sequence[int] | None = None,
        *,
        presence_penalty: Any = 0.0,
        frequency_penalty: Any = 0.0,
        repetition_penalty: Any = 1.0,
        logit_bias: Any = None,
        min_tokens: Any = 0,
        min_p: Any = 0.0,
        top_k: Any = 0,
        logprobs: Any = None,
    ) -> SamplingParams:
        def bad(param, value, why):
            raise ConfigError(f"{param}={value!r}: {why}", param=param)

        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 1
        ):
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
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63
        ):
            bad("seed", seed, "use an integer in [0, 2**63) or none.")
        ids = tuple(stop_token_ids or ())
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            bad("stop_token_ids", list(ids), "use a list of token ids (integers >= 0).")
        processing = _checked_processing(
            bad,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            logit_bias,
            min_tokens,
            min_p,
            top_k,
            logprobs,
            max_new_tokens,
        )
        return cls(
            int(max_new_tokens), float(temperature), float(top_p), stop, seed, ids, **processing
        )

    @property
    def processed(self) -> bool:
        """Whether the logits are changed before sampling (penalties, bias, ``min_tokens``)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def _checked_processing(
    bad,
    presence_penalty,
    frequency_penalty,
    repetition_penalty,
    logit_bias,
    min_tokens,
    min_p,
    top_k,
    logprobs,
    max_new_tokens,
) -> dict:
    """The logits-processing fields of :meth:`SamplingParams.checked`, normalised."""

    def number(name, v, low, high, low_open=False):
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not math.isfinite(v)
            or v > high
            or (v <= low if low_open else v < low)
        ):
            bad(name, v, f"use a number in {'(' if low_open else '['}{low}, {high}].")
        return float(v)

    def integer(name, v, low, high):
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            bad(name, v, f"use an integer in [{low}, {high}].")
        return int(v)

    out = {
        "presence_penalty": number("presence_penalty", presence_penalty, -2, 2),
        "frequency_penalty": number("frequency_penalty", frequency_penalty, -2, 2),
        "repetition_penalty": number(
            "repetition_penalty", repetition_penalty, 0, 1e6, low_open=True
        ),
        "min_p": number("min_p", min_p, 0, 1),
        "top_k": 0 if top_k == -1 else integer("top_k", top_k, 0, 1 << 30),
        "min_tokens": integer("min_tokens", min_tokens, 0, max_new_tokens),
        "logprobs": None if logprobs is None else integer("logprobs", logprobs, 0, 20),
    }
    bias = {}
    if isinstance(logit_bias, dict):
        logit_bias = list(logit_bias.items())
    elif logit_bias is None:
        logit_bias = []
    elif not isinstance(logit_bias, (list, tuple)):
        bad("logit_bias", logit_bias, "use a mapping of token ids to biases in [-100, 100].")
    for item in logit_bias:
        tok, b = item if isinstance(item, (list, tuple)) and len(item) == 2 else (item, None)
        t = (
            int(tok) if isinstance(tok, str) and tok.isascii() and tok.isdecimal() else tok
        )  # JSON keys are strings
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            bad("logit_bias", tok, "every key must be a token id (an integer >= 0).")
        bias[t] = number("logit_bias", b, -100, 100)
    out["logit_bias"] = tuple(sorted(bias.items()))
    return out


def check_prompt(
    ids: Any,
    vocab_size: int,
    context_length: int | None,
    max_new_tokens: int,
    index: int | None = None,
) -> list[int]:
    """A prompt's token ids as a list of ints, checked: non-empty, every id in ``[0, vocab_size)``,
    and prompt + ``max_new_tokens`` within the model's context (when it has a known one)."""
    where = "prompt" if index is None else f"prompt {index}"
    if not isinstance(ids, list) or not ids:
        raise ConfigError(f"{where} is empty; give at least one token.", param="prompt")
    bad = [
        t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
    ]
    if bad:
        raise ConfigError(
            f"{where} holds token id {bad[0]!r}, outside the vocabulary [0, {vocab_size}).",
            param="prompt",
        )
    if context_length:
        if len(ids) >= context_length:
            raise ConfigError(
                f"{where} has {len(ids)} tokens; the model's context is {context_length} tokens. "
                f"Shorten the prompt.",
                param="prompt",
            )
        if len(ids) + max_new_tokens > context_length:
            raise ConfigError(
                f"{where} has {len(ids)} tokens and max_new_tokens is {max_new_tokens}: together "
                f"they exceed the model's context of {context_length} tokens; use max_new_tokens "
                f"<= {context_length - len(ids)}.",
                param="max_new_tokens",
            )
    return ids
