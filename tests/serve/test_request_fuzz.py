"""Fuzzing request bodies (hypothesis) against a live server over the fake engine: whatever the
body, the answer is 2xx or 4xx (never 500), nothing is logged at ERROR, and the server keeps
serving (``/health`` ok, a plain request answered) after every example."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from conftest import live_server
from fakes import FakeDecoder, FakeParams
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(600)

# any JSON value (strings with lone surrogates included: they survive json.dumps as \\ud83d escapes)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "stop_token_ids",
    "seed",
    "stream",
    "stream_options",
    "n",
    "best_of",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "top_k",
    "min_p",
    "min_tokens",
    "logit_bias",
    "echo",
    "suffix",
    "tools",
    "response_format",
]
# plausible values (so that many examples reach the decoder and stream), then anything
PLAUSIBLE = {
    "model": st.sampled_from([None, "fake"]),
    "max_tokens": st.none() | st.integers(1, 40),
    "max_completion_tokens": st.none() | st.integers(1, 40),
    "temperature": st.sampled_from([None, 0, 0.0]),
    "top_p": st.none() | st.floats(0.05, 1),
    "stop": st.none()
    | st.text(min_size=1, max_size=3)
    | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.none() | st.lists(st.integers(0, 200), max_size=3),
    "seed": st.none() | st.integers(0, 2**63 - 1),
    "stream": st.sampled_from([None, False, True]),
    "stream_options": st.sampled_from([None, {"include_usage": True}, {"include_usage": None}]),
    "n": st.none() | st.integers(1, 3),
    "user": st.none() | st.text(max_size=8),
    "presence_penalty": st.sampled_from([None, 0, 0.0]),
    "repetition_penalty": st.sampled_from([None, 1, 1.0]),
    "top_k": st.sampled_from([None, -1, 0]),
    "logprobs": st.sampled_from([None, False]),
    "logit_bias": st.sampled_from([None, {}]),
}
FIELDS = list(PLAUSIBLE) + [
    "best_of",
    "frequency_penalty",
    "top_logprobs",
    "min_p",
    "min_tokens",
    "echo",
    "suffix",
    "tools",
    "response_format",
]


def fields(plausible: bool):
    if plausible:
        return PLAUSIBLE
    return {
        f: st.integers(-3, 120)
        | st.floats(-2, 3, allow_nan=False)
        | st.sampled_from([None, True, "x"])
        | json_values
        for f in FIELDS
    }


text = st.text(
    st.characters(codec="utf-8") | st.characters(categories=["Cs"]), max_size=30
)  # lone surrogates too
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"])},
    optional={
        "content": text
        | st.none()
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2),
        "name": st.none(),
    },
)
bad_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "wizard"]) | json_values},
    optional={"content": json_values, "name": json_values},
)
prompt = (
    text
    | st.lists(st.integers(0, 300), min_size=1, max_size=20)
    | st.lists(text, min_size=1, max_size=3)
)
bad_prompt = st.lists(st.integers(-5, 0x10FFFF + 5), max_size=20) | json_values
chat_body = st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=3)}, optional=fields(True)
) | st.fixed_dictionaries(
    {"messages": st.lists(bad_message, max_size=3) | json_values}, optional=fields(False)
)
completion_body = st.fixed_dictionaries(
    {"prompt": prompt}, optional=fields(True)
) | st.fixed_dictionaries({"prompt": prompt | bad_prompt}, optional=fields(False))
raw_bytes = st.binary(max_size=200)


def _encode(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


@pytest.fixture(scope="module")
def server():
    from redraft.serve.app import create_app

    app = create_app(
        FakeDecoder(per_step=16),
        "fake",
        sampling_params=FakeParams,
        warmup=False,
        max_batch=4,
        max_queue=8,
        max_request_bytes=4096,
    )
    with live_server(app) as url:
        with httpx.Client(base_url=url, timeout=30) as client:
            yield client


@settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    case=st.one_of(
        st.tuples(st.just("/v1/chat/completions"), chat_body | raw_bytes),
        st.tuples(st.just("/v1/completions"), completion_body | raw_bytes),
    )
)
def test_no_request_body_gets_a_500(server, case, caplog):
    path, body = case
    with caplog.at_level(logging.ERROR):
        r = server.post(path, content=_encode(body), headers={"content-type": "application/json"})
    event(
        f"HTTP {r.status_code}"
    )  # --hypothesis-show-statistics: how many examples reached the decoder
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error"
    elif isinstance(body, dict) and body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], body
    assert server.get("/health").json()["status"] == "ok"


def test_the_server_serves_after_the_fuzzing(server):
    r = server.post("/v1/completions", json={"prompt": "still here", "max_tokens": 4})
    assert r.json()["choices"][0]["text"] == "stil"
    assert 'outcome="error"' not in server.get("/metrics").text
