"""One HTTP request as several scheduler jobs: ``n`` choices per prompt, several prompts per
completions request (OpenAI's semantics: choice ``index = prompt * n + j``).

    body, lengths, jobs = JobBuilder(decoder, ...)(raw_body, "chat", loop)   # one job per choice
    fan = FanIn(jobs)                                # their messages on one queue, tagged with the index
    msg = await fan.next(disconnect)                 # (index, (kind, payload)) or None: client gone

Each choice is an independent request in the batch (its own row, its own seed); nothing here
touches the decoder. Seeds of choices ``j > 0`` derive from the request's seed
(:func:`choice_seed`), so a seeded ``n=4`` request is reproducible and its choices differ.
"""

from __future__ import annotations

import asyncio
import hashlib

from redraft.errors import ConfigError
from redraft.serve import protocol as P
from redraft.serve.scheduler import Job


def choice_seed(seed: int | None, j: int) -> int | None:
    """The seed of choice ``j`` of a request seeded with ``seed``: choice 0 keeps it (``n=1``
    gives the same text as choice 0 of ``n=4``); the others hash (seed, j) to 63 bits."""
    if seed is None or j == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{j}".encode()).digest()[:8], "big") >> 1


class JobBuilder:
    """Request body -> (parsed body, prompt lengths, one :class:`Job` per choice): parse and
    check, tokenize, build each choice's sampling parameters. The server runs it on a worker
    thread (a long prompt's tokenisation must not hold the event loop).

    Args:
        decoder: has ``encode()`` and ``target.vocab_size``.
        model_name: the served model id (requests may name it or omit it).
        make_params: ``SamplingParams.checked`` (it checks the ranges, naming the field).
        default_max_tokens, context: new tokens when a request sets none, capped by the context
            (``None``: unknown).
        max_choices: prompts x n beyond this (``--max-batch`` + ``--max-queue``) can never be
            admitted together: a 400 naming ``n``.
    """

    def __init__(
        self,
        decoder,
        model_name: str,
        make_params,
        default_max_tokens: int,
        context: int | None,
        max_choices: int,
    ):
        self.decoder, self.model_name, self.make_params = decoder, model_name, make_params
        self.default_max_tokens, self.context, self.max_choices = (
            default_max_tokens,
            context,
            max_choices,
        )
        self.vocab = getattr(decoder.target, "vocab_size", None)

    def __call__(self, raw: bytes, kind: str, loop) -> tuple[P._Request, list[int], list[Job]]:
        body = P.parse_request(raw, P.ChatRequest if kind == "chat" else P.CompletionRequest)
        body.check(self.model_name)
        if kind == "chat":
            prompts = [self.encode(body.chat(), "messages")]
        else:  # token ids are checked (non-empty, in the vocabulary, within the context) by engine.add
            prompts = [
                list(x) if isinstance(x, list) else self.encode(x, "prompt") for x in body.prompts
            ]
        if len(prompts) * body.choices > self.max_choices:
            raise P.APIError(
                400,
                f"{len(prompts)} prompt(s) x n={body.choices} choices exceed what this server "
                f"holds at once ({self.max_choices}: --max-batch + --max-queue); send fewer.",
                param="n" if body.choices > 1 else "prompt",
            )
        jobs = [
            Job(ids, self.params(body, len(ids), choice_seed(body.seed, j)), loop)
            for ids in prompts
            for j in range(body.choices)
        ]
        for job in jobs:
            job.max_tokens_name = (
                body.max_tokens_name
            )  # engine.add's errors name the client's field
        return body, [len(ids) for ids in prompts], jobs

    def params(self, body: P._Request, n_prompt: int, seed: int | None):
        """One choice's sampling parameters (``make_params``'s errors in the client's words)."""
        max_new = body.max_new_tokens
        if max_new is None:
            cap = self.default_max_tokens if self.context is None else self.context - n_prompt
            max_new = max(1, min(self.default_max_tokens, cap))
        extra = {}
        if (
            body.stop_token_ids
        ):  # only when asked: a params class without the field still serves the rest
            if self.vocab and (bad := [t for t in body.stop_token_ids if not 0 <= t < self.vocab]):
                raise P.APIError(
                    400,
                    f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {self.vocab}).",
                    param="stop_token_ids",
                )
            extra["stop_token_ids"] = tuple(body.stop_token_ids)
        extra.update(body.sampling_fields())  # only those the client set
        try:
            return self.make_params(
                max_new_tokens=max_new,
                seed=seed,
                stop=body.stops,
                temperature=0.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                **extra,
            )
        except ConfigError as exc:
            raise P.config_error(exc, body.max_tokens_name) from None

    def encode(self, x, param: str) -> list[int]:
        from jinja2.exceptions import TemplateError

        try:
            return self.decoder.encode(x)[0]  # encode normalises to a batch; this is one prompt
        except ConfigError as exc:
            raise P.APIError(400, f"{param}: {exc}", param=param) from None
        except TemplateError as exc:  # e.g. a template that insists on alternating roles
            raise P.APIError(
                400,
                f"{param}: the model's chat template rejected these messages ({exc}).",
                param=param,
            ) from None


def _final(msg) -> bool:
    kind, payload = msg
    return kind == "error" or (kind == "event" and payload.done)


class FanIn:
    """The messages of several jobs on one queue, as ``(index, (kind, payload))``."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs
        self.queue: asyncio.Queue = asyncio.Queue()
        self._pumps = [asyncio.ensure_future(self._pump(i, job)) for i, job in enumerate(jobs)]

    async def _pump(self, i: int, job: Job) -> None:
        while True:
            msg = await job.queue.get()
            self.queue.put_nowait((i, msg))
            if _final(msg):
                return

    async def next(self, disconnect: asyncio.Future):
        """The next message of any job, or None when ``disconnect`` completes first."""
        get = asyncio.ensure_future(self.queue.get())
        await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
        return None

    def close(self) -> None:
        for p in self._pumps:
            p.cancel()
