"""What a vLLM / OpenAI user sends, against a live server over the fake engine: request bodies
that must not hurt the server (size limit, invalid Unicode, deep nesting, slow tokenisation off
the event loop), ``null`` for optional fields, parameters that are not implemented (400 unless
neutral), ``n`` choices and several prompts, ``stop_token_ids``, ``HEAD /health``, CORS, and
metrics that stay true after disconnects."""

from __future__ import annotations

import json
import logging
import socket
import threading

import httpx
import openai
import pytest
from fakes import CONTEXT, expected

pytestmark = pytest.mark.timeout(120)
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def post(url, path, body, **kw):
    if isinstance(body, bytes):
        return httpx.post(
            f"{url}{path}",
            content=body,
            headers={"content-type": "application/json"},
            timeout=30,
            **kw,
        )
    return httpx.post(f"{url}{path}", json=body, timeout=30, **kw)


def metric(url, name) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


# ---------------------------------------------------------------------------------- bodies that must not hurt


def test_body_over_the_limit_is_413_naming_it(fake_server):
    url, _, _ = fake_server(max_request_bytes=1000)
    r = post(url, COMP, {"prompt": "x" * 2000})
    assert r.status_code == 413
    err = r.json()["error"]
    assert (
        err["code"] == "request_too_large"
        and "1000 bytes" in err["message"]
        and "--max-request-bytes" in err["message"]
    )

    def chunks():  # no Content-Length: the limit holds while reading
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"y" * 100
        yield b'"}'

    r = httpx.post(
        f"{url}{COMP}", content=chunks(), headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 413 and "more than 1000" in r.json()["error"]["message"]
    assert post(url, COMP, {"prompt": "ok", "max_tokens": 2}).json()["choices"][0]["text"] == "ok"


def test_tokenisation_runs_off_the_event_loop(fake_server):
    """While one request's prompt is being tokenized, /health and other requests are answered."""
    url, dec, _ = fake_server()
    out = {}
    t = threading.Thread(
        target=lambda: out.update(r=post(url, COMP, {"prompt": "SLOW prompt", "max_tokens": 4}))
    )
    t.start()
    assert dec.encoding.wait(30)  # the tokenizer is busy now, and stays busy until released
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    assert (
        post(url, COMP, {"prompt": "fast", "max_tokens": 4}).json()["choices"][0]["text"] == "fast"
    )
    assert t.is_alive()
    dec.slow_encode.set()
    t.join(30)
    assert out["r"].json()["choices"][0]["text"] == "SLOW"


@pytest.mark.parametrize(
    "path,raw,param",
    [
        (CHAT, b'{"messages": [{"role": "user", "content": "x\\ud83d y"}]}', "messages[0].content"),
        (
            CHAT,
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
            "messages[0].content[0].text",
        ),
        (COMP, b'{"prompt": "abc\\ud83d def"}', "prompt"),
        (COMP, b'{"prompt": "a", "stop": ["\\ud800"]}', "stop[0]"),
        (COMP, b'{"prompt": "a", "user": {"\\ud800": 1}}', "user"),
        (COMP, b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
        (COMP, b'{"prompt": "a", "x": ' + b"[" * 40 + b"]" * 40 + b"}", "x"),
        (COMP, b'{"prompt": "\xff\xfe"}', None),
        (COMP, b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}", None),
        (COMP, b'{"prompt": "a", "max_tokens": 1e400}', "max_tokens"),
        (COMP, b'{"prompt": "a", "seed": 100000000000000000000000}', "seed"),
        (COMP, b'{"prompt": "a", "temperature": NaN}', None),
        (COMP, b'{"prompt": "a", "top_p": -Infinity}', None),
    ],
)
def test_undecodable_input_is_400_naming_the_field(fake_server, path, raw, param, caplog):
    url, _, _ = fake_server()
    with caplog.at_level(logging.ERROR):
        r = post(url, path, raw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert post(url, COMP, {"prompt": "ok", "max_tokens": 2}).status_code == 200


# ---------------------------------------------------------------------------------- fields as clients send them


def test_null_means_the_default_for_every_optional_field(fake_server):
    url, _, _ = fake_server()
    nulls = {
        k: None
        for k in (
            "model",
            "max_tokens",
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
            "logprobs",
            "top_logprobs",
            "top_k",
            "logit_bias",
        )
    }
    r = post(url, COMP, {"prompt": "nul", **nulls})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [expected("nul", CONTEXT - 3)[0]]
    r = post(
        url,
        CHAT,
        {
            "messages": [{"role": "user", "content": "chat", "name": None}],
            "max_completion_tokens": None,
            **nulls,
        },
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("chat")
    # the official client sends what it was given, null included
    got = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).completions.create(
        model="fake", prompt="oai", max_tokens=3, n=None, stream=None, extra_body={"top_k": None}
    )
    assert got.choices[0].text == "oai"


@pytest.mark.parametrize(
    "path,field,neutral,other",
    [
        (COMP, "echo", [False], [True]),
        (COMP, "prompt_logprobs", [], [0, 2]),
        (COMP, "typical_p", [1], [0.5]),
        (CHAT, "response_format", [{"type": "text"}], [{"type": "json_object"}]),
        (CHAT, "tools", [[]], [[{"type": "function", "function": {"name": "f"}}]]),
        (COMP, "best_of", [1], [3]),
    ],
)
def test_unimplemented_parameters_are_400_unless_neutral(fake_server, path, field, neutral, other):
    """Never a 200 that ignores what the client asked for: only the value that asks for nothing
    passes (each field's own). The penalties, logit_bias, min_p, top_k, min_tokens and logprobs
    are implemented: tests/serve/test_sampling_fields.py."""
    url, _, _ = fake_server()
    base = {"messages": MSG} if path == CHAT else {"prompt": "ab"}
    for v in neutral:
        r = post(url, path, {**base, "max_tokens": 2, field: v})
        assert r.status_code == 200, (field, v, r.text)
    for v in other:
        r = post(url, path, {**base, "max_tokens": 2, field: v})
        assert r.status_code == 400, (field, v, r.text)
        assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_errors_name_the_clients_own_field(fake_server, field):
    url, _, _ = fake_server()
    r = post(url, CHAT, {"messages": MSG, field: 1_000_000_000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field
    assert field in err["message"] and "max_new_tokens" not in err["message"]
    r = post(url, CHAT, {"messages": MSG, field: 0})
    assert (
        r.json()["error"]["param"] == field and "max_new_tokens" not in r.json()["error"]["message"]
    )


# ---------------------------------------------------------------------------------- n, several prompts, stop ids


def test_n_choices_with_derived_seeds(fake_server):
    """n=3 with a seed: three choices, choice 0 equal to the n=1 answer, the others from their
    own derived seeds (the fake starts a row at seed % len(prompt)), the same on every call."""
    from redraft.serve.choices import choice_seed

    url, _, _ = fake_server()
    body = {"prompt": "abcdefghij", "max_tokens": 5, "seed": 7, "n": 3}
    r = post(url, COMP, body).json()
    texts = [c["text"] for c in r["choices"]]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert texts == [expected("abcdefghij", 5, seed=choice_seed(7, j))[0] for j in range(3)]
    assert len(set(texts)) == 3 and texts[0] == "hijab"
    assert texts[0] == post(url, COMP, {**body, "n": 1}).json()["choices"][0]["text"]
    assert [c["text"] for c in post(url, COMP, body).json()["choices"]] == texts
    assert r["usage"] == {"prompt_tokens": 10, "completion_tokens": 15, "total_tokens": 25}
    assert len(r["redraft"]["choices"]) == 3


def test_n_choices_streamed_interleave_with_their_index(fake_server):
    url, _, _ = fake_server(step_delay=0.01, per_step=1)
    body = {
        "messages": [{"role": "user", "content": "abcdef"}],
        "max_tokens": 6,
        "seed": 1,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}{CHAT}", json=body, timeout=30) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    objs = [json.loads(ln[6:]) for ln in lines[:-1]]
    from redraft.serve.choices import choice_seed

    for j in range(2):
        mine = [o["choices"][0] for o in objs if o["choices"] and o["choices"][0]["index"] == j]
        assert mine[0]["delta"]["role"] == "assistant"
        assert (
            "".join(c["delta"].get("content") or "" for c in mine)
            == expected("abcdef", 6, seed=choice_seed(1, j))[0]
        )
        assert [c["finish_reason"] for c in mine].count("length") == 1
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 12


def test_several_prompts_in_one_completions_request(fake_server):
    url, _, _ = fake_server()
    r = post(url, COMP, {"prompt": ["ab", "xyz"], "max_tokens": 4, "n": 2}).json()
    assert [c["text"] for c in r["choices"]] == ["abab", "abab", "xyzx", "xyzx"]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["usage"]["prompt_tokens"] == 5 and r["usage"]["completion_tokens"] == 16
    r = post(url, COMP, {"prompt": [[104, 105], [111]], "max_tokens": 3}).json()
    assert [c["text"] for c in r["choices"]] == ["hih", "ooo"]
    # one prompt refused (too long) refuses the request, naming the field
    r = post(url, COMP, {"prompt": ["ok", "x" * CONTEXT], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_too_many_choices_is_400_naming_n(fake_server):
    url, _, _ = fake_server(max_batch=2, max_queue=2)
    r = post(url, COMP, {"prompt": "a", "n": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert post(url, COMP, {"prompt": "a", "n": 4, "max_tokens": 1}).status_code == 200


def test_stop_token_ids(fake_server):
    url, _, _ = fake_server()
    r = post(
        url, COMP, {"prompt": "hello world", "max_tokens": 20, "stop_token_ids": [ord("w")]}
    ).json()
    assert r["choices"][0]["text"] == "hello " and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == 7  # the stop token is generated, its text left out
    r = post(url, COMP, {"prompt": "a", "stop_token_ids": [10**8]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"


# ---------------------------------------------------------------------------------- operations


def test_head_health_and_cors(fake_server):
    url, _, _ = fake_server()
    r = httpx.head(f"{url}/health")
    assert r.status_code == 200 and r.content == b""
    pre = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    assert "access-control-allow-origin" not in httpx.options(f"{url}{CHAT}", headers=pre).headers
    url, _, _ = fake_server(cors_origins=["https://app.example"], api_key="k")
    r = httpx.options(f"{url}{CHAT}", headers=pre)
    assert (
        r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    )
    assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.post(
        f"{url}{COMP}",
        json={"prompt": "ab", "max_tokens": 2},
        headers={"Origin": "https://app.example", "Authorization": "Bearer k"},
    )
    assert (
        r.json()["choices"][0]["text"] == "ab"
        and r.headers["access-control-allow-origin"] == "https://app.example"
    )
    r = httpx.options(f"{url}{CHAT}", headers={**pre, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_metrics_prompt_tokens_kv_cache_and_counts_from_one_source(fake_server):
    url, dec, app = fake_server(step_delay=0.05, per_step=1)
    post(url, COMP, {"prompt": "abcd", "max_tokens": 3})
    assert metric(url, "redraft_prompt_tokens_total") == 4.0
    # a streamed client leaves mid-way: batch size drops with /health's running count, no step needed
    with httpx.stream(
        "POST", f"{url}{COMP}", json={"prompt": "gone", "max_tokens": 80, "stream": True}
    ) as resp:
        lines = resp.iter_lines()
        next(lines), next(lines)
        assert metric(url, "redraft_batch_size") == 1.0
        assert metric(url, "redraft_prompt_tokens_total") == 8.0
        assert (
            metric(url, "redraft_kv_cache_capacity_tokens") == CONTEXT
        )  # the fake allocates CONTEXT per row
        held = metric(url, "redraft_kv_cache_tokens")
        assert (
            4 < held < CONTEXT and 4 / CONTEXT < metric(url, "redraft_kv_cache_usage") < 1
        )  # steps go on meanwhile
    import time

    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert httpx.get(f"{url}/health").json()["running"] == 0
    assert metric(url, "redraft_batch_size") == 0.0 and metric(url, "redraft_queue_depth") == 0.0


def test_client_gone_mid_body_is_a_cancellation_not_an_error(fake_server, caplog):
    url, _, _ = fake_server()
    host, port = url.removeprefix("http://").split(":")
    with caplog.at_level(logging.INFO):
        s = socket.create_connection((host, int(port)))
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": "ab'
        )
        s.close()
        import time

        deadline = time.monotonic() + 10
        while (
            'outcome="cancelled"' not in httpx.get(f"{url}/metrics").text
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
    text = httpx.get(f"{url}/metrics").text
    assert (
        'redraft_requests_total{outcome="cancelled"} 1.0' in text and 'outcome="error"' not in text
    )
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
