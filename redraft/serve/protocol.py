"""The OpenAI wire format: request models and error objects (response and stream-chunk builders:
``redraft.serve.responses``, re-exported here).

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
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP = 16  # stop strings per request (OpenAI allows 4; a long list costs a scan per step)
MAX_LOGPROBS = 20  # alternatives per token (vLLM's limit; OpenAI's chat allows 20, completions 5)
MAX_DEPTH = (
    32  # JSON nesting of a request body (an OpenAI request needs ~6; a deep body costs recursion)
)
# OpenAI and vLLM fields that redraft-serve does not implement (yet), with the values that ask for
# nothing (null is always neutral). Any other value answers 400 naming the field, never a 200 that
# ignores it. Numbers compare by value (0 == 0.0), booleans only with booleans.
NEUTRAL: dict[str, tuple] = {
    # sampling (penalties, logit_bias, min_p, top_k, min_tokens are fields of _Request)
    "typical_p": (1,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "ignore_eos": (False,),
    "length_penalty": (1,),
    "use_beam_search": (False,),
    # what comes back (logprobs / top_logprobs are fields)
    "prompt_logprobs": (),
    "echo": (False,),
    "suffix": ("",),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
    # prompt building
    "add_special_tokens": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": (),
    "truncate_prompt_tokens": (),
    # structured output, tools, other modalities
    "response_format": ({"type": "text"},),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
}


def _same(value, neutral) -> bool:
    """``value == neutral`` by JSON type: ``True == 1`` in Python, so booleans match only booleans."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with HTTP ``status`` (and extra ``headers``)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def config_error(exc, max_tokens: str = "max_tokens") -> APIError:
    """A 400 from a ``redraft.errors.RedraftError``: a ``ConfigError``'s ``param`` names the
    field, in the client's words (the decoder's ``max_new_tokens`` is the request's ``max_tokens``
    or ``max_completion_tokens``: ``max_tokens`` names which), in ``param`` and in the message."""
    param = getattr(exc, "param", None)
    message = str(exc)
    if param == "max_new_tokens":
        param, message = max_tokens, message.replace("max_new_tokens", max_tokens)
    return APIError(400, message, param=param)


# ---------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = False


class _Request(BaseModel):
    """Fields chat and completions share; ``null`` is the default for every optional field (as
    OpenAI and vLLM take it). Unknown fields are kept (``model_extra``) and ignored unless they
    are in :data:`NEUTRAL` with a value that asks for something (see :meth:`check`)."""

    model_config = ConfigDict(extra="allow", strict=True)
    neutral: ClassVar[dict] = NEUTRAL  # per-endpoint differences below
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    best_of: int | None = None
    user: str | None = None
    # logits processing (redraft.infer.SamplingParams checks the ranges, naming the field)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    top_k: int | None = None
    min_tokens: int | None = None

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

    @field_validator("stop_token_ids", mode="after")
    @classmethod
    def _stop_ids(cls, v):
        if v is not None and len(v) > MAX_STOP * 4:
            raise ValueError(
                f"stop_token_ids holds {len(v)} ids; at most {MAX_STOP * 4} are allowed"
            )
        return v

    def check(self, served: str) -> None:
        """Checks that need no model: the model name, ``n``, ``stream_options``, unsupported fields."""
        if self.model is not None and self.model != served:
            raise APIError(
                400,
                f"model {self.model!r} is not served here; this server serves {served!r} "
                f"(GET /v1/models).",
                param="model",
                code="model_not_found",
            )
        if self.n is not None and self.n < 1:
            raise APIError(
                400, f"n={self.n}: use an integer >= 1 (the number of choices).", param="n"
            )
        if self.best_of is not None and self.best_of != self.choices:
            raise APIError(
                400,
                f"best_of={self.best_of} is not supported by redraft-serve (it returns every "
                f"choice it samples); leave it unset or equal to n ({self.choices}).",
                param="best_of",
            )
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options is only allowed with stream=true.", param="stream_options"
            )
        extra = self.model_extra or {}
        for name, neutral in self.neutral.items():
            value = extra.get(name)
            if value is not None and not any(_same(value, v) for v in neutral):
                allowed = " or ".join(["null", *(json.dumps(v) for v in neutral)])
                raise APIError(
                    400,
                    f"{name}={json.dumps(value)[:80]} is not supported by redraft-serve; leave it "
                    f"unset (send {allowed}).",
                    param=name,
                )

    def sampling_fields(self) -> dict:
        """The logits-processing fields the client set (``SamplingParams.checked`` keywords),
        ``logprobs`` (the decoder's count of alternatives, or None) included."""
        names = (
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "logit_bias",
            "min_p",
            "top_k",
            "min_tokens",
        )
        out = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.top_alternatives is not None:
            out["logprobs"] = self.top_alternatives
        return out

    @property
    def top_alternatives(self) -> int | None:
        """Log-probabilities asked for: the alternatives per token (0 to 20), None if none."""
        return None

    @property
    def choices(self) -> int:
        """Choices per prompt (``n``; null means 1)."""
        return 1 if self.n is None else self.n

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
    content: str | list[TextPart] | None  # null: an assistant turn with no text
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def check(self, served: str) -> None:
        super().check(served)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(
                400,
                f"top_logprobs={self.top_logprobs}: use an integer in [0, {MAX_LOGPROBS}].",
                param="top_logprobs",
            )

    @property
    def top_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict]:
        """The messages as the ``{"role", "content"}`` dicts a chat template reads."""
        return [{"role": m.role, "content": m.text} for m in self.messages]

    @property
    def max_tokens_name(self) -> str:
        """The field the client limited its output with (for error messages)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def max_new_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(
                400,
                "give max_tokens or max_completion_tokens, not both.",
                param="max_completion_tokens",
            )
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # a count: 0 already asks for the sampled token's log-probability

    def check(self, served: str) -> None:
        super().check(served)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(
                400,
                f"logprobs={self.logprobs}: use an integer in [0, {MAX_LOGPROBS}].",
                param="logprobs",
            )

    @property
    def top_alternatives(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v):
        # OpenAI: one prompt (text or token ids) or a batch of them (one choice each, n per prompt)
        if isinstance(v, str) or _ids(v):
            return v
        if (
            isinstance(v, list)
            and v
            and (all(isinstance(x, str) for x in v) or all(_ids(x) for x in v))
        ):
            return v
        raise ValueError(
            "prompt must be a string, a list of token ids, or a non-empty list of either "
            "(several prompts)"
        )

    @property
    def prompts(self) -> list:
        """The request's prompts: each a string or a list of token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) or not p else list(p)

    @property
    def max_tokens_name(self) -> str:
        return "max_tokens"

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens


def _ids(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _param(loc: tuple) -> str | None:
    """``("messages", 0, "content")`` -> ``"messages[0].content"``; pydantic's union tags
    (``"str"``, ``"list[TextPart]"``...) are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (
            isinstance(part, str)
            and part.isidentifier()
            and part.islower()
            and part not in ("str", "int", "float", "bool", "list", "dict", "none")
        ):
            out += f".{part}" if out else part
    return out or None


def _is_utf8(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")  # fails on lone surrogates ("\\ud83d" escapes in JSON)
        return True
    except UnicodeEncodeError:
        return False


def check_body(data) -> None:
    """Every string of a parsed body (keys too) must be valid Unicode, and nesting at most
    :data:`MAX_DEPTH` deep; a 400 names the field otherwise. Iterative: no recursion on deep input."""
    stack = [(data, ())]
    while stack:
        x, loc = stack.pop()
        if len(loc) > MAX_DEPTH:
            param = _param(loc[:1])
            raise APIError(
                400,
                f"{param or 'the request body'}: JSON nested more than {MAX_DEPTH} levels deep.",
                param=param,
            )
        if isinstance(x, str):
            if not _is_utf8(x):
                param = _param(loc)
                raise APIError(
                    400,
                    f"{param or 'the request body'}: holds a lone UTF-16 surrogate (e.g. a "
                    f"'\\ud83d' escape without its pair), which is not valid Unicode; send UTF-8 text.",
                    param=param,
                    code="invalid_unicode",
                )
        elif isinstance(x, dict):
            for k, v in x.items():
                if not _is_utf8(k):
                    param = _param(loc)
                    raise APIError(
                        400,
                        f"{param or 'the request body'}: a key holds a lone UTF-16 surrogate; "
                        f"send valid UTF-8.",
                        param=param,
                        code="invalid_unicode",
                    )
                stack.append((v, (*loc, k)))
        elif isinstance(x, list):
            stack.extend((v, (*loc, i)) for i, v in enumerate(x))


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_request(raw: bytes, model: type[_Request]) -> _Request:
    """Parse a request body; malformed JSON, invalid Unicode, deep nesting or any invalid field
    -> a 400 :class:`APIError` that names the (first) field at fault."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(
            400,
            f"the request body is nested too deeply; at most {MAX_DEPTH} levels are allowed.",
            code="invalid_json",
        ) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a number with too many digits
        raise APIError(
            400, f"the request body is not valid JSON ({str(exc)[:200]}).", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}.")
    check_body(data)
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


# the response side, re-exported here (callers use protocol.response, protocol.ChunkWriter, ...)
from redraft.serve.responses import (  # noqa: E402, F401
    FINISH_REASON,
    LOGPROB_FLOOR,
    ChunkWriter,
    logprobs_json,
    model_card,
    new_id,
    redraft_stats,
    response,
    usage,
)
