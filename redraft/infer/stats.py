"""What a request gets back: its text and tokens, and the decoding statistics.

Two measures of speculation are reported, because papers and engines use both:

* ``tokens_per_call`` (tau): new tokens / target forwards, the prefill included (exactly 1 for
  plain decoding). What the wall-clock speedup follows.
* ``mean_accepted_length``: the vLLM / Spec-Bench definition, accepted draft tokens + 1 per
  verify step, the prefill excluded (also 1 for plain decoding). What papers compare drafters
  with; it is larger than tau for short outputs.
* ``acceptance_per_position[i]``: the fraction of verify steps that accepted at least ``i + 1``
  draft tokens (vLLM's per-position acceptance rate).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RequestStats:
    """Per-request decoding statistics (times are the batch's, for the steps this request was in)."""

    new_tokens: int = 0
    target_calls: int = 1  # the prefill produced the first token
    accepted_hist: Counter = field(default_factory=Counter)  # accepted draft tokens per verify step
    draft_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV entries came from the prefix cache
    total_time: float = 0.0
    drafter_accepted: Counter = field(
        default_factory=Counter
    )  # name -> accepted tokens it proposed
    # the drafter gate's view (redraft.infer.spec.gate.DrafterGate): steps each drafter was called,
    # and over the steps where two or more were, the accepted tokens each got that no other
    # called drafter had proposed (its "exclusive gain", summed) and how many such steps
    drafter_calls: Counter = field(default_factory=Counter)
    drafter_exclusive: Counter = field(default_factory=Counter)
    joint_steps: int = 0
    tree_entries: int = 0  # draft tokens proposed (before prefix sharing, after pruning)
    tree_nodes: int = 0  # tree nodes verified (after sharing, root excluded)
    tree_entries_raw: int = 0  # draft tokens proposed before pruning

    @property
    def verify_steps(self) -> int:
        return sum(self.accepted_hist.values())

    @property
    def accepted_tokens(self) -> int:
        return sum(k * v for k, v in self.accepted_hist.items())

    @property
    def tokens_per_call(self) -> float:
        return self.new_tokens / max(self.target_calls, 1)

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens + 1 per verify step (vLLM / Spec-Bench; prefill excluded)."""
        steps = self.verify_steps
        return (self.accepted_tokens + steps) / steps if steps else 1.0

    def acceptance_per_position(self) -> list[float]:
        """``[i]``: fraction of verify steps that accepted at least ``i + 1`` draft tokens."""
        steps = self.verify_steps
        if not steps or not self.accepted_hist:
            return []
        deepest = max(self.accepted_hist)
        return [
            sum(v for k, v in self.accepted_hist.items() if k > i) / steps for i in range(deepest)
        ]

    def drafter_share(self) -> dict:
        """Each drafter's share of the accepted draft tokens (a token several drafters proposed
        counts for each, so shares can sum to more than 1)."""
        total = self.accepted_tokens
        return {k: v / max(total, 1) for k, v in self.drafter_accepted.items()}

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_calls": self.target_calls,
            "tokens_per_call": round(self.tokens_per_call, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_per_position": [round(x, 4) for x in self.acceptance_per_position()],
            "accepted_hist": dict(sorted(self.accepted_hist.items())),
            "draft_time_s": round(self.draft_time, 4),
            "verify_time_s": round(self.verify_time, 4),
            "prefill_time_s": round(self.prefill_time, 4),
            "cached_tokens": self.cached_tokens,
            "total_time_s": round(self.total_time, 4),
            "drafter_accepted": dict(self.drafter_accepted),
            "drafter_share": {k: round(v, 4) for k, v in self.drafter_share().items()},
            "drafter_calls": dict(self.drafter_calls),
            "drafter_exclusive": dict(self.drafter_exclusive),
            "joint_steps": self.joint_steps,
            "tree_entries_proposed": self.tree_entries_raw,
            "tree_entries": self.tree_entries,
            "tree_nodes": self.tree_nodes,
        }


@dataclass
class TokenLogprob:
    """One output token's log-probability (``SamplingParams.logprobs``): ``token``, ``logprob``
    and ``top``, the ``logprobs`` likeliest tokens at that position as ``(token, logprob)``,
    likeliest first. Log-probabilities of the distribution the token was drawn from (processed
    logits at the request's temperature, after min_p / top_k / top_p; greedy: temperature 1)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Generation:
    """One request's result: ``text`` (decoded new tokens, cut at a stop string), ``tokens``
    (new token ids), ``finish_reason`` ("eos", "length" or "stop") and ``stats``; ``logprobs``
    (one :class:`TokenLogprob` per token) when the request asked for them."""

    text: str
    tokens: list[int]
    finish_reason: str
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None


@dataclass
class StreamEvent:
    """Text and tokens accepted in one step for request ``index`` (``done`` on its last event,
    which carries the :class:`Generation`)."""

    index: int
    text: str
    tokens: list[int]
    done: bool = False
    generation: Generation | None = None
    logprobs: list[TokenLogprob] | None = None  # of ``tokens``, when the request asked for them
