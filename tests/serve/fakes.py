"""A small fake of the decoder's step-level engine, for the HTTP-layer tests (auth, errors, 429,
disconnects, SIGTERM, SSE framing): it implements the engine interface the server drives
(``add`` / ``cancel`` / ``step`` / ``has_work``) with characters as tokens, so a test knows
each request's exact output without a model. The live tests with a real tiny target are in
test_live.py.

Output of a row: the prompt's characters in order, cycled, ``per_step`` tokens per step, until
``max_new_tokens`` ("length"), a stop string ("stop", text cut before it) or a stop token id
("stop", its character left out of the text). A seeded row starts at character ``seed % len(prompt)``
(so choices with different seeds differ).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from redraft.errors import ConfigError

CONTEXT = 96
VOCAB = 0x110000  # tokens are Unicode code points


@dataclass(frozen=True)
class FakeParams:
    """Stand-in for ``redraft.infer.SamplingParams`` with the same fields and range checks."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple = ()
    seed: int | None = None
    stop_token_ids: tuple = ()

    @classmethod
    def checked(cls, **kw) -> FakeParams:
        from redraft.infer.config import SamplingParams

        SamplingParams.checked(
            **kw
        )  # the real range checks (penalties, logit_bias, ...: the fake ignores them)
        kw = {k: v for k, v in kw.items() if k in cls.__dataclass_fields__}
        return cls(
            **{
                **kw,
                "stop": tuple(kw.get("stop") or ()),
                "stop_token_ids": tuple(kw.get("stop_token_ids") or ()),
            }
        )

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ConfigError(
                f"max_new_tokens={self.max_new_tokens} must be >= 1.", param="max_new_tokens"
            )
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0.", param="temperature")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must lie in (0, 1].", param="top_p")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must not be empty.", param="stop")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ConfigError(
                f"seed={self.seed}: use an integer in [0, 2**63) or none.", param="seed"
            )


@dataclass
class Generation:
    """Same fields as ``redraft.infer.Generation`` (not imported: that pulls in torch, and the
    SIGTERM tests start this fake in fresh processes)."""

    text: str
    tokens: list
    finish_reason: str
    stats: object


@dataclass
class StreamEvent:
    """Same fields as ``redraft.infer.StreamEvent``."""

    index: int
    text: str
    tokens: list
    done: bool = False
    generation: Generation | None = None


@dataclass
class FakeStats:
    new_tokens: int = 0
    target_calls: int = 1
    mean_accepted_length: float = 2.0
    tokens_per_call: float = 0.0

    @property
    def verify_steps(self) -> int:
        return self.target_calls - 1

    def drafter_share(self) -> dict:
        return {"fake": 1.0}

    def to_dict(self) -> dict:
        return {"new_tokens": self.new_tokens}


def expected(
    prompt: str, max_new_tokens: int, stop=(), seed: int | None = None, stop_token_ids=()
) -> tuple[str, str]:
    """(text, finish_reason) the fake engine produces for ``prompt`` (plain text prompt)."""
    start = (seed or 0) % len(prompt)
    text = "".join(
        itertools.islice(itertools.cycle(prompt[start:] + prompt[:start]), max_new_tokens)
    )
    for i, c in enumerate(text):
        if ord(c) in stop_token_ids:
            text = text[:i]
            cut = min((text.find(s) for s in stop if s in text), default=-1)
            return (text[:cut] if cut >= 0 else text), "stop"
    cut = min((text.find(s) for s in stop if s in text), default=-1)
    return (text[:cut], "stop") if cut >= 0 else (text, "length")


@dataclass
class _Row:
    prompt: list[int]
    params: FakeParams
    out: list[int] = field(default_factory=list)
    sent: int = 0
    stats: FakeStats = field(default_factory=FakeStats)


class FakeEngine:
    """The engine interface over :class:`_Row` s (see the module doc). Records what the server
    did: ``added`` (rid, rows already running, step), ``cancelled`` rids, ``max_rows``."""

    def __init__(self, owner: FakeDecoder):
        self.owner = owner
        self.rows: dict[int, _Row] = {}
        self.joining: dict[int, _Row] = {}
        self.next_rid = 0
        self.steps = 0
        self.added: list[tuple[int, int, int]] = []
        self.cancelled: list[int] = []
        self.max_rows = 0
        self.thread_ids: set[int] = set()

    def add(self, prompt_ids, params) -> int:
        self.thread_ids.add(threading.get_ident())
        if not prompt_ids or min(prompt_ids) < 0 or max(prompt_ids) >= VOCAB:
            raise ConfigError(
                f"prompt is empty or holds a token id outside [0, {VOCAB}).", param="prompt"
            )
        text = "".join(map(chr, prompt_ids))
        if "FAIL_ADD" in text:
            raise RuntimeError("fake add failure")
        if params.temperature > 0:
            raise ConfigError("temperature > 0 needs acceptance='rejection'.", param="temperature")
        if len(prompt_ids) >= CONTEXT:
            raise ConfigError(
                f"the prompt has {len(prompt_ids)} tokens; the context holds {CONTEXT}.",
                param="prompt",
            )
        if len(prompt_ids) + params.max_new_tokens > CONTEXT:
            raise ConfigError(
                f"prompt + max_new_tokens exceeds the context {CONTEXT}.", param="max_new_tokens"
            )
        rid = self.next_rid
        self.next_rid += 1
        self.added.append((rid, len(self.rows), self.steps))
        self.joining[rid] = _Row(list(prompt_ids), params)
        return rid

    def cancel(self, rid: int) -> None:
        self.thread_ids.add(threading.get_ident())
        self.cancelled.append(rid)
        self.rows.pop(rid, None)
        self.joining.pop(rid, None)

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self.joining)

    @property
    def kv_usage(self) -> tuple[int, int]:
        """(tokens held, slots allocated): prompt + output of running rows, CONTEXT slots per row."""
        return sum(len(r.prompt) + len(r.out) for r in self.rows.values()), CONTEXT * len(self.rows)

    def step(self) -> list[StreamEvent]:
        self.thread_ids.add(threading.get_ident())
        self.rows.update(self.joining)
        self.joining = {}
        self.max_rows = max(self.max_rows, len(self.rows))
        self.steps += 1
        if self.owner.step_delay:
            time.sleep(self.owner.step_delay)
        if any("FAIL_STEP" in "".join(map(chr, r.prompt)) for r in self.rows.values()):
            raise RuntimeError("fake step failure")
        events = []
        for rid, r in list(self.rows.items()):
            p = r.params
            start = (p.seed or 0) % len(r.prompt)
            hit = False
            for _ in range(self.owner.per_step):
                if len(r.out) < p.max_new_tokens and not hit:
                    r.out.append(r.prompt[(start + len(r.out)) % len(r.prompt)])
                    hit = r.out[-1] in p.stop_token_ids
            text = "".join(map(chr, r.out[:-1] if hit else r.out))
            cut = min((text.find(s) for s in p.stop if s in text), default=-1)
            reason = (
                "stop"
                if cut >= 0 or hit
                else ("length" if len(r.out) >= p.max_new_tokens else None)
            )
            if cut >= 0:
                text = text[:cut]
            new = r.out[r.sent :]
            delta = text[min(r.sent, len(text)) :]
            r.sent = len(r.out)
            r.stats.new_tokens = len(r.out)
            r.stats.target_calls = self.steps
            if reason:
                del self.rows[rid]
                events.append(
                    StreamEvent(
                        rid, delta, new, True, Generation(text, list(r.out), reason, r.stats)
                    )
                )
            else:
                events.append(StreamEvent(rid, delta, new))
        return events


class FakeDecoder:
    """What the server needs of a decoder: ``engine()``, ``encode()``, ``target`` (tokenizer,
    vocab size, context length)."""

    def __init__(self, step_delay: float = 0.0, per_step: int = 2):
        self.step_delay, self.per_step = step_delay, per_step
        self.engines: list[FakeEngine] = []
        # a prompt holding "SLOW" is tokenized only once this is set (a tokenizer busy on a huge prompt)
        self.slow_encode = threading.Event()
        self.encoding = threading.Event()  # set while such a prompt waits
        self.target = SimpleNamespace(
            vocab_size=VOCAB,
            spec="fake",
            model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=CONTEXT)),
        )

    @property
    def engine_(self) -> FakeEngine:
        return self.engines[-1]

    def engine(self) -> FakeEngine:
        self.engines.append(FakeEngine(self))
        return self.engines[-1]

    def encode(self, x) -> list[int]:
        if isinstance(
            x, list
        ):  # chat: the last message's content is the prompt (keeps outputs predictable)
            x = x[-1]["content"]
        if not x:
            raise ConfigError("prompt 0 is empty after tokenisation; give at least one token.")
        if "SLOW" in x:
            self.encoding.set()
            self.slow_encode.wait(60)
        return [[ord(c) for c in x]]  # a batch of one, like SpeculativeDecoder.encode
