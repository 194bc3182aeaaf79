"""The OpenAI wire format: request models, error objects, response and stream-chunk builders.

Requests are parsed here (pydantic, strict types) so that every bad field becomes one
:class:`APIError` whose ``param`` names it, in OpenAI's error shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

Ranges that depend on the decoder (temperature against its acceptance rule, ``max_tokens``
against the context, stop strings) are checked by ``redraft.infer.SamplingParams`` and
``engine.add``, not here: one place for those checks; their ``ConfigError.param`` becomes the
error's ``param`` (:func:`config_error`).

Nothing here imports torch.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# finish reasons: the decoder's ("eos", "length", "stop") -> OpenAI's ("stop", "length")
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length"}
MAX_STOP = 16  # stop strings per request (OpenAI allows 4; a long list costs a scan per step)
# OpenAI fields redraft-serve cannot honour: a request that sets one to a non-default value gets a
# 400 naming it rather than an answer that silently ignores it
UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "functions", "logit_bias", "presence_penalty",
               "frequency_penalty", "best_of", "echo", "suffix", "response_format", "tool_choice",
               "function_call", "audio", "modalities", "prediction")
NEUTRAL = (None, 0, 1, "", "none", "auto", "text", [], {}, {"type": "text"})


def _neutral(value) -> bool:
    """A value that asks for nothing (``True == 1`` in Python, so booleans are checked apart)."""
    return value is False if isinstance(value, bool) else value in NEUTRAL


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with HTTP ``status`` (and extra ``headers``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def config_error(exc) -> APIError:
    """A 400 from a ``redraft.errors.RedraftError`` (a ``ConfigError``'s ``param`` names the
    field; the decoder's ``max_new_tokens`` is the API's ``max_tokens``)."""
    param = getattr(exc, "param", None)
    return APIError(400, str(exc), param={"max_new_tokens": "max_tokens"}.get(param, param))


# ---------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    """Fields chat and completions share. Unknown fields are kept (``model_extra``) and ignored
    unless they are in :data:`UNSUPPORTED` with a non-default value."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("stop must be a string or a list of strings")
        if len(v) > MAX_STOP:
            raise ValueError(f"stop holds {len(v)} strings; at most {MAX_STOP} are allowed")
        return v

    def check(self, served: str) -> None:
        """Checks that need no model: the model name, ``n``, ``stream_options``, unsupported fields."""
        if self.model is not None and self.model != served:
            raise APIError(400, f"model {self.model!r} is not served here; this server serves {served!r} "
                                f"(GET /v1/models).", param="model", code="model_not_found")
        if self.n != 1:
            raise APIError(400, f"n={self.n}: redraft-serve returns exactly one choice; use n=1 "
                                f"(send several requests for several samples).", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true.", param="stream_options")
        for name in UNSUPPORTED:
            value = (self.model_extra or {}).get(name)
            if not _neutral(value):
                raise APIError(400, f"{name}={value!r} is not supported by redraft-serve; leave it unset.",
                               param=name)

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def chat(self) -> list[dict]:
        """The messages as the ``{"role", "content"}`` dicts a chat template reads."""
        return [{"role": m.role, "content": m.text} for m in self.messages]

    @property
    def max_new_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both.", param="max_completion_tokens")
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        # OpenAI allows a batch of prompts (one choice each); here one request is one prompt
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"prompt holds {len(v)} prompts; send one prompt per request")
            v = v[0]
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        raise ValueError("prompt must be a string or a list of token ids")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens


def _param(loc: tuple) -> str | None:
    """``("messages", 0, "content")`` -> ``"messages[0].content"``; pydantic's union tags
    (``"str"``, ``"list[TextPart]"``...) are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part.islower() and part not in (
                "str", "int", "float", "bool", "list", "dict", "none"):
            out += f".{part}" if out else part
    return out or None


def parse_request(raw: bytes, model: type[_Request]) -> _Request:
    """Parse a request body; malformed JSON or any invalid field -> a 400 :class:`APIError`
    that names the (first) field at fault."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc}).", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = _param(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "is required"
        elif err["type"] == "too_short" and param == "messages":
            msg = "must hold at least one message"
        raise APIError(400, f"{param}: {msg}.", param=param) from None


# ---------------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def redraft_stats(generation) -> dict:
    """The ``redraft`` extension field: how the speculative decoder did on this request."""
    s = generation.stats
    out = {"finish_reason": generation.finish_reason, "new_tokens": s.new_tokens, "target_calls": s.target_calls,
           "tokens_per_call": round(s.tokens_per_call, 4),
           "mean_accepted_length": round(float(s.mean_accepted_length), 4),
           "drafter_share": {k: round(v, 4) for k, v in s.drafter_share().items()}}
    if getattr(s, "tree_nodes", None) is not None:  # draft nodes verified per step: the per-row budget used
        out["tree_nodes_per_step"] = round(s.tree_nodes / max(s.verify_steps, 1), 2)
    return out


def response(kind: str, rid: str, model: str, generation, prompt_tokens: int) -> dict:
    """A complete (non-streamed) ``chat.completion`` or ``text_completion`` object."""
    reason = FINISH_REASON[generation.finish_reason]
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": generation.text},
                  "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": generation.text, "logprobs": None, "finish_reason": reason}
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, len(generation.tokens)), "redraft": redraft_stats(generation)}


class ChunkWriter:
    """Server-sent events of one streamed request, in OpenAI's chunk schema.

    Chat: a first chunk with ``delta.role``, then ``delta.content`` chunks, then a chunk with an
    empty delta and ``finish_reason`` (and the ``redraft`` stats); with ``include_usage`` every
    chunk has ``"usage": null`` and one last chunk has ``"choices": []`` and the usage. Then
    ``data: [DONE]``.
    """

    def __init__(self, kind: str, rid: str, model: str, include_usage: bool):
        self.kind, self.id, self.model, self.include_usage = kind, rid, model, include_usage
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def _chunk(self, choices: list, **extra) -> str:
        obj = {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            obj["usage"] = None
        obj.update(extra)
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def _choice(self, text: str | None, reason: str | None, role: bool = False) -> dict:
        if self.kind == "chat":
            delta = {} if text is None else {"content": text}
            if role:
                delta = {"role": "assistant", "content": ""}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}

    def start(self) -> str:
        """The opening chunk (chat only: the assistant role; completions send nothing)."""
        return self._chunk([self._choice(None, None, role=True)]) if self.kind == "chat" else ""

    def delta(self, text: str) -> str:
        return self._chunk([self._choice(text, None)]) if text else ""

    def finish(self, generation, prompt_tokens: int) -> str:
        out = self._chunk([self._choice(None, FINISH_REASON[generation.finish_reason])],
                          redraft=redraft_stats(generation))
        if self.include_usage:
            out += self._chunk([], usage=usage(prompt_tokens, len(generation.tokens)))
        return out

    @staticmethod
    def error(err: APIError) -> str:
        return f"data: {json.dumps(err.body())}\n\n"

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"


def model_card(name: str, context: int) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "redraft",
            "max_model_len": context}
