"""The OpenAI wire format, the response side: response bodies, stream chunks and log-probabilities
in OpenAI's shapes (request parsing and errors are ``redraft.serve.protocol``'s).

Nothing here imports torch.
"""

from __future__ import annotations

import json
import time
import uuid

# finish reasons: the decoder's ("eos", "length", "stop") -> OpenAI's ("stop", "length")
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length"}


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def redraft_stats(generation) -> dict:
    """The ``redraft`` extension field: how the speculative decoder did on this request."""
    s = generation.stats
    out = {
        "finish_reason": generation.finish_reason,
        "new_tokens": s.new_tokens,
        "target_calls": s.target_calls,
        "tokens_per_call": round(s.tokens_per_call, 4),
        "mean_accepted_length": round(float(s.mean_accepted_length), 4),
        "drafter_share": {k: round(v, 4) for k, v in s.drafter_share().items()},
    }
    if (
        getattr(s, "tree_nodes", None) is not None
    ):  # draft nodes verified per step: the per-row budget used
        out["tree_nodes_per_step"] = round(s.tree_nodes / max(s.verify_steps, 1), 2)
    if getattr(s, "prefill_time", None) is not None:  # of the time to first token: prefill forwards
        out["prefill_time_s"] = round(s.prefill_time, 4)
    if getattr(s, "cached_tokens", None) is not None:  # prompt tokens the prefix cache gave
        out["cached_tokens"] = s.cached_tokens
    return out


LOGPROB_FLOOR = -9999.0  # OpenAI's log-probability of an impossible token (JSON has no -Infinity)


def _lp(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR) if x == x else LOGPROB_FLOOR


def logprobs_json(kind: str, items, token_text, offset: int = 0) -> dict | None:
    """OpenAI's ``logprobs`` object of ``redraft.infer.TokenLogprob`` items (None: not asked):
    chat ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``, completions
    ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (offsets from ``offset``).
    ``token_text(id)``: a token's text."""
    if items is None:
        return None
    if kind == "chat":

        def entry(t, lp):
            s = token_text(t)
            return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8", "replace"))}

        return {
            "content": [
                {**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                for x in items
            ]
        }
    toks, offsets = [token_text(x.token) for x in items], []
    for s in toks:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": toks,
        "token_logprobs": [_lp(x.logprob) for x in items],
        "top_logprobs": [_by_text(x.top, token_text) for x in items],
        "text_offset": offsets,
    }


def _by_text(top, token_text) -> dict:
    """``{text: logprob}`` of the likeliest-first ``top``; tokens that decode alike (pieces of one
    UTF-8 character) keep the likeliest one's value."""
    out: dict = {}
    for t, v in top:
        out.setdefault(token_text(t), _lp(v))
    return out


def response(
    kind: str, rid: str, model: str, generations: list, prompt_tokens: int, token_text=str
) -> dict:
    """A complete (non-streamed) ``chat.completion`` or ``text_completion`` object, one choice
    per generation. ``redraft`` holds the decoder's stats of the one choice, or
    ``{"choices": [stats per choice]}`` when there are several. ``token_text(id)`` spells the
    tokens of ``logprobs``."""
    choices = []
    for i, g in enumerate(generations):
        reason = FINISH_REASON[g.finish_reason]
        lp = logprobs_json(kind, getattr(g, "logprobs", None), token_text)
        if kind == "chat":
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": g.text},
                    "logprobs": lp,
                    "finish_reason": reason,
                }
            )
        else:
            choices.append({"index": i, "text": g.text, "logprobs": lp, "finish_reason": reason})
    stats = [redraft_stats(g) for g in generations]
    return {
        "id": rid,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, sum(len(g.tokens) for g in generations)),
        "redraft": stats[0] if len(stats) == 1 else {"choices": stats},
    }


class ChunkWriter:
    """Server-sent events of one streamed request, in OpenAI's chunk schema.

    Chat: a first chunk with ``delta.role`` (per choice), then ``delta.content`` chunks, then a
    chunk per choice with an empty delta and ``finish_reason`` (and that choice's ``redraft``
    stats); with ``include_usage`` every chunk has ``"usage": null`` and one last chunk has
    ``"choices": []`` and the usage of all choices. Then ``data: [DONE]``. Choices of an ``n > 1``
    request interleave, each chunk naming its ``index``.
    """

    def __init__(self, kind: str, rid: str, model: str, include_usage: bool, token_text=str):
        self.kind, self.id, self.model, self.include_usage = kind, rid, model, include_usage
        self.token_text = token_text
        self._offsets: dict = {}  # choice -> characters sent (completions' text_offset)
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def _chunk(self, choices: list, **extra) -> str:
        obj = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            obj["usage"] = None
        obj.update(extra)
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def _choice(
        self, index: int, text: str | None, reason: str | None, role: bool = False, logprobs=None
    ) -> dict:
        if self.kind == "chat":
            delta = {} if text is None else {"content": text}
            if role:
                delta = {"role": "assistant", "content": ""}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}

    def start(self, n: int = 1) -> str:
        """The opening chunks (chat only: the assistant role of each choice; completions send nothing)."""
        if self.kind != "chat":
            return ""
        return "".join(self._chunk([self._choice(i, None, None, role=True)]) for i in range(n))

    def delta(self, text: str, index: int = 0, logprobs=None) -> str:
        """A content chunk (none when there is neither text nor log-probabilities)."""
        if not text and not logprobs:
            return ""
        lp = None
        if logprobs:
            lp = logprobs_json(self.kind, logprobs, self.token_text, self._offsets.get(index, 0))
            self._offsets[index] = self._offsets.get(index, 0) + sum(
                len(t) for t in lp.get("tokens", ())
            )
        return self._chunk([self._choice(index, text, None, logprobs=lp)])

    def finish(self, generation, index: int = 0) -> str:
        return self._chunk(
            [self._choice(index, None, FINISH_REASON[generation.finish_reason])],
            redraft=redraft_stats(generation),
        )

    def usage(self, generations: list, prompt_tokens: int) -> str:
        return self._chunk([], usage=usage(prompt_tokens, sum(len(g.tokens) for g in generations)))

    @staticmethod
    def error(err) -> str:  # a protocol.APIError
        return f"data: {json.dumps(err.body())}\n\n"

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"


def model_card(name: str, context: int) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "redraft",
        "max_model_len": context,
    }
