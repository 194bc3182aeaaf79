"""Who writes the replies when distilling: a small protocol, and Hugging Face ``generate`` as
the implementation every install has.

:func:`redraft.data.distill.distill` only needs *something* that turns prompts (token ids) into
the target's replies. It keeps such a :class:`ReplyGenerator` busy: ``submit`` a prompt whenever
fewer than ``batch_size`` are in flight, ``poll`` for the replies that finished, submit the next
turns and the next conversations, and so on. A generator with continuous batching (redraft's own
engine, ``redraft.infer.replies.EngineReplies``) returns each reply as soon as it ends and the
freed slot is refilled at its next step; :class:`HFReplies` runs one left-padded
``model.generate`` over everything submitted (a fixed batch that waits for its longest reply).

The layering rule keeps ``data`` and ``train`` from importing ``infer``, so the engine is
injected from above: the console scripts (``redraft.entry``) and ``redraft-demo`` run their work
inside :func:`use_replies` with the engine's factory; without one, :func:`make_replies` falls
back to :class:`HFReplies`. Greedy replies are the same token for token from both in float32
(``tests/infer/test_replies.py``); in bfloat16 rounding flips near-ties differently for different
batch shapes, in either generator.

Torch is imported only when a generator is made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple, Protocol


@dataclass(frozen=True)
class ReplySettings:
    """What every reply of one distillation run is generated with.

    Attributes:
        max_new_tokens: new tokens per reply at most.
        stop_ids: token ids that end a reply (the target's end-of-sequence ids); the reply
            excludes the one that ended it.
        temperature: 0 = greedy; otherwise sampling with ``top_p`` (no top-k cut).
        top_p: nucleus threshold, in (0, 1].
        seed: the run's seed (a generator that seeds per request derives its seeds from it).
        batch_size: prompts in flight at most (the caller never submits more).
        speculate: a generator that can draft (redraft's engine) may speculate; the replies are
            the same tokens (greedy) or follow the same distribution (sampling) either way.
    """

    max_new_tokens: int
    stop_ids: tuple[int, ...]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 8
    speculate: bool = True


class Reply(NamedTuple):
    """One finished reply: the ``key`` it was submitted with, its new token ids up to (not
    including) the stop id, and whether a stop id ended it (False: it ran into max_new_tokens)."""

    key: int
    tokens: list[int]
    stopped: bool


class ReplyGenerator(Protocol):
    """Turns submitted prompts into replies, keeping as many in flight as it is given."""

    name: str  # what the progress bar and logs call it ("engine", "hf-generate")

    def submit(self, key: int, prompt: list[int]) -> None:
        """Queue ``prompt`` (token ids, chat template applied); its reply comes back with ``key``."""

    def poll(self) -> list[Reply]:
        """Generate until at least one submitted prompt has its reply (if any is in flight) and
        return the finished ones, in any order; ``[]`` when nothing is in flight."""


ReplyFactory = Callable[
    ["object", ReplySettings], ReplyGenerator
]  # (target, settings) -> generator

_FACTORY: ContextVar[ReplyFactory | None] = ContextVar("redraft_reply_factory", default=None)


@contextmanager
def use_replies(factory: ReplyFactory) -> Iterator[None]:
    """Within the block, distillation that is given no generator uses ``factory(target,
    settings)`` (the console scripts pass the engine's; see ``redraft.entry``)."""
    token = _FACTORY.set(factory)
    try:
        yield
    finally:
        _FACTORY.reset(token)


def make_replies(target, settings: ReplySettings, factory: ReplyFactory | None = None):
    """``factory``, else the one :func:`use_replies` set, else :class:`HFReplies`, applied to
    ``(target, settings)``."""
    return (factory or _FACTORY.get() or HFReplies)(target, settings)


class HFReplies:
    """The fallback: everything submitted since the last ``poll`` in one left-padded
    ``model.generate`` (:func:`generate_replies`)."""

    name = "hf-generate"

    def __init__(self, target, settings: ReplySettings):
        self.target, self.settings = target, settings
        self.pending: list[tuple[int, list[int]]] = []

    def submit(self, key: int, prompt: list[int]) -> None:
        self.pending.append((key, list(prompt)))

    def poll(self) -> list[Reply]:
        if not self.pending:
            return []
        batch, self.pending = self.pending, []
        s = self.settings
        out = generate_replies(
            self.target,
            [p for _, p in batch],
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            stop_ids=s.stop_ids,
        )
        return [Reply(key, toks, stopped) for (key, _), (toks, stopped) in zip(batch, out)]


def generate_replies(
    target,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: tuple[int, ...] | None = None,
) -> list[tuple[list[int], bool]]:
    """One batched ``generate`` over left-padded prompts.

    Returns, per prompt, the new token ids up to (not including) the first stop id (default: the
    target's end-of-sequence ids), and whether it stopped by itself (False: it ran into
    ``max_new_tokens``).
    """
    import torch

    tok, model = target.tokenizer, target.model
    eos = list(stop_ids) if stop_ids else list(target.eos_token_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    width = max(len(p) for p in prompts)
    # [B, width]: left padding so every prompt's last token sits in the last column
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    sample = temperature > 0
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids.to(target.device),
            attention_mask=attention.to(target.device),
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=temperature if sample else None,
            top_p=top_p if sample else None,
            top_k=0 if sample else None,  # no hidden top-k cut
            pad_token_id=pad,
            eos_token_id=eos,
        )
    new = out[:, width:].cpu()  # [B, <= max_new_tokens]
    is_eos = torch.isin(new, torch.tensor(eos))
    has_eos = is_eos.any(dim=1)
    # first eos position per row (the row length when there is none), vectorised
    stop = torch.where(
        has_eos,
        is_eos.int().argmax(dim=1),
        torch.full_like(has_eos, new.shape[1], dtype=torch.long),
    )
    return [(new[i, : int(stop[i])].tolist(), bool(has_eos[i])) for i in range(len(prompts))]
