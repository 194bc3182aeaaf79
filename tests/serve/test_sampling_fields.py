"""The sampling parameters and log-probabilities on a live server over the real engine (tiny
random target, float32, CPU, the context n-gram drafter with a fixed budget: trees are real):
each answer equals the engine's own output for the same ``SamplingParams``, in OpenAI's shapes."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import live_server

pytestmark = pytest.mark.timeout(300)

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. The quick brown"}]


@pytest.fixture(scope="module")
def served(tiny_target):
    from redraft.infer import load_decoder
    from redraft.serve.app import create_app

    dec = load_decoder(tiny_target, context=True, budget=12, acceptance="rejection")
    with live_server(create_app(dec, "tiny", max_batch=8, max_queue=16)) as url:
        yield url, dec


def engine_output(dec, prompt_ids, **params):
    """What the engine gives for this request (the reference)."""
    from redraft.infer import SamplingParams

    eng = dec.engine()
    eng.add(prompt_ids, SamplingParams.checked(**params))
    while eng.has_work:
        for ev in eng.step():
            if ev.done:
                return ev.generation


def test_chat_logprobs_and_penalties_are_the_engines(served, tiny_target):
    url, dec = served
    body = {
        "messages": MSG,
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 2,
        "frequency_penalty": 1.0,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.2,
        "logit_bias": {"7": -100},
        "top_k": 5,
        "min_p": 0.1,
    }
    r = httpx.post(url + CHAT, json=body, timeout=120).json()
    want = engine_output(
        dec,
        dec.encode(MSG)[0],
        max_new_tokens=12,
        logprobs=2,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={7: -100},
        top_k=5,
        min_p=0.1,
    )
    choice = r["choices"][0]
    assert choice["message"]["content"] == want.text
    content = choice["logprobs"]["content"]
    text = tiny_target.tokenizer.decode
    assert [c["token"] for c in content] == [text([t]) for t in want.tokens]
    assert [c["logprob"] for c in content] == pytest.approx(
        [x.logprob for x in want.logprobs], abs=1e-5
    )
    assert all(
        len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode()) for c in content
    )
    assert [[t["token"] for t in c["top_logprobs"]] for c in content] == [
        [text([t]) for t, _ in x.top] for x in want.logprobs
    ]
    # streamed: the chunks' log-probabilities, concatenated, are the same
    chunks = []
    with httpx.stream("POST", url + CHAT, json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                import json

                for ch in json.loads(line[6:])["choices"]:
                    if ch.get("logprobs"):
                        chunks += ch["logprobs"]["content"]
    assert [c["token"] for c in chunks] == [c["token"] for c in content]
    assert [c["logprob"] for c in chunks] == pytest.approx(
        [c["logprob"] for c in content], abs=1e-6
    )


def test_completions_logprobs_in_openais_shape(served, tiny_target):
    url, dec = served
    r = httpx.post(
        url + COMP,
        json={"prompt": "def add(a, b):", "max_tokens": 8, "logprobs": 3, "min_tokens": 4},
        timeout=120,
    ).json()
    lp = r["choices"][0]["logprobs"]
    want = engine_output(
        dec, dec.encode("def add(a, b):")[0], max_new_tokens=8, logprobs=3, min_tokens=4
    )
    assert len(lp["tokens"]) == len(want.tokens) == r["usage"]["completion_tokens"]
    assert lp["token_logprobs"] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-5)
    # a dict by token text (OpenAI's shape): tokens that decode alike (partial UTF-8) share an entry
    assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"])
    assert all(
        max(t.values()) >= x - 1e-6 for t, x in zip(lp["top_logprobs"], lp["token_logprobs"])
    )
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_the_openai_client_sends_them(served):
    url, _ = served
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    out = c.chat.completions.create(
        model="tiny",
        messages=MSG,
        max_tokens=6,
        logprobs=True,
        top_logprobs=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"5": 2},
        extra_body={"top_k": 4, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2},
    )
    assert len(out.choices[0].logprobs.content) == out.usage.completion_tokens


@pytest.mark.parametrize(
    "path,body,param",
    [
        (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (COMP, {"prompt": "hi", "logprobs": 21}, "logprobs"),
        (COMP, {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        (COMP, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        (COMP, {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
        (COMP, {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        (COMP, {"prompt": "hi", "top_k": -2}, "top_k"),
        (COMP, {"prompt": "hi", "min_p": 2}, "min_p"),
        (COMP, {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ],
)
def test_bad_values_are_400_naming_the_field(served, path, body, param):
    url, _ = served
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
