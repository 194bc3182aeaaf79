"""The HTTP layer against a live server over the fake engine (tests/serve/fakes.py): OpenAI
schema and SSE framing with the official client, every bad input, auth, 429, disconnects,
faults that stay with their request, metrics. Outputs are known exactly from ``fakes.expected``."""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fakes import CONTEXT, expected

pytestmark = pytest.mark.timeout(120)


def client(url, key="none", **kw):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30, **kw)


def sse_lines(resp) -> list[str]:
    return [line for line in resp.iter_lines() if line]


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


# ---------------------------------------------------------------------------------- schema


def test_chat_completion_openai_client(fake_server):
    url, dec, _ = fake_server()
    r = client(url).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "abc"}], max_tokens=7
    )
    assert r.choices[0].message.content == expected("abc", 7)[0] == "abcabca"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "fake"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 7, 10)
    ext = r.model_extra["redraft"]
    assert ext["finish_reason"] == "length" and ext["new_tokens"] == 7
    assert ext["mean_accepted_length"] == 2.0 and ext["drafter_share"] == {"fake": 1.0}


def test_completion_stop_string_and_seed_passed(fake_server):
    url, dec, _ = fake_server()
    r = client(url).completions.create(
        model="fake", prompt="hello world", max_tokens=20, stop=["wor", "zz"], seed=3
    )
    assert r.choices[0].text == expected("hello world", 20, ("wor", "zz"), seed=3)[0] == "lo "
    assert r.choices[0].finish_reason == "stop"
    assert r.object == "text_completion"


def test_chat_stream_openai_client_with_usage(fake_server):
    url, _, _ = fake_server()
    stream = client(url).chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "xyz"}],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected("xyz", 9)[0]
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["redraft"]["new_tokens"] == 9
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_sse_framing(fake_server):
    """Raw SSE: every event is one ``data: {json}`` line, the last is ``data: [DONE]``; the
    streamed text equals the non-streamed text."""
    url, _, _ = fake_server()
    body = {"model": "fake", "prompt": "stream me", "max_tokens": 11, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = sse_lines(resp)
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    objs = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(o["object"] == "text_completion" and "usage" not in o for o in objs)
    assert "".join(o["choices"][0]["text"] for o in objs) == expected("stream me", 11)[0]
    assert [o["choices"][0]["finish_reason"] for o in objs].count("length") == 1
    assert len({o["id"] for o in objs}) == 1


def test_models_health_and_prompt_token_ids(fake_server):
    url, _, _ = fake_server()
    models = client(url).models.list()
    assert [m.id for m in models.data] == ["fake"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [104, 105], "max_tokens": 3}).json()
    assert r["choices"][0]["text"] == "hih"  # model omitted: the served one


# ---------------------------------------------------------------------------------- bad input

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path,body,param",
    [
        (CHAT, b"{not json", None),
        (CHAT, b"[1, 2]", None),
        (CHAT, {"model": "fake"}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": "user", "content": ""}]}, "messages"),
        (CHAT, {"messages": MSG, "model": "gpt-4"}, "model"),
        (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": MSG, "max_tokens": -5}, "max_tokens"),
        (CHAT, {"messages": MSG, "max_tokens": "ten"}, "max_tokens"),
        (CHAT, {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
        (CHAT, {"messages": MSG, "max_tokens": CONTEXT}, "max_tokens"),
        (CHAT, {"messages": MSG, "temperature": -0.5}, "temperature"),
        (CHAT, {"messages": MSG, "temperature": 0.7}, "temperature"),
        (CHAT, {"messages": MSG, "top_p": 0}, "top_p"),
        (CHAT, {"messages": MSG, "top_p": 1.5}, "top_p"),
        (CHAT, {"messages": MSG, "n": 0}, "n"),
        (CHAT, {"messages": MSG, "stop": [1, 2]}, "stop"),
        (CHAT, {"messages": MSG, "stop": [""]}, "stop"),
        (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
        (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"messages": [{"role": "user", "content": "x" * CONTEXT}]}, "prompt"),
        (COMP, {"prompt": "x" * (CONTEXT + 10), "max_tokens": 1}, "prompt"),
        (COMP, {"prompt": ""}, "prompt"),
        (COMP, {"prompt": ["a", 3]}, "prompt"),
        (COMP, {"prompt": [-1, 3]}, "prompt"),
        (COMP, {"prompt": {"text": "a"}}, "prompt"),
        (COMP, {"max_tokens": 3}, "prompt"),
    ],
)
def test_bad_input_is_400_naming_the_field(fake_server, path, body, param):
    url, dec, app = fake_server()
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(f"{url}{path}", timeout=30, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    # the loop is still serving
    ok = httpx.post(f"{url}{COMP}", json={"prompt": "ok", "max_tokens": 2}, timeout=30)
    assert ok.json()["choices"][0]["text"] == "ok"


def test_openai_client_raises_bad_request(fake_server):
    url, _, _ = fake_server()
    with pytest.raises(openai.BadRequestError) as info:
        client(url).chat.completions.create(model="fake", messages=MSG, top_p=2.0)
    assert info.value.body["param"] == "top_p"


def test_unknown_path_is_an_openai_style_404(fake_server):
    url, _, _ = fake_server()
    r = httpx.get(f"{url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"]


# ---------------------------------------------------------------------------------- auth


def test_api_key(fake_server, monkeypatch):
    import redraft.serve.app as app_mod

    calls = []
    real = app_mod.hmac.compare_digest
    monkeypatch.setattr(app_mod.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    url, _, _ = fake_server(api_key="s3cret")
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").models.list()
    r = httpx.post(f"{url}{COMP}", json={"prompt": "a"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    assert (
        httpx.post(
            f"{url}{COMP}", json={"prompt": "a"}, headers={"Authorization": "Basic s3cret"}
        ).status_code
        == 401
    )
    assert (
        client(url, key="s3cret")
        .completions.create(model="fake", prompt="ab", max_tokens=3)
        .choices[0]
        .text
        == "aba"
    )
    assert len(calls) == 4  # every keyed request went through the constant-time comparison
    assert httpx.get(f"{url}/health").status_code == 200  # operations endpoints stay open
    assert httpx.get(f"{url}/metrics").status_code == 200


# ---------------------------------------------------------------------------------- batching, queue


def test_requests_join_a_running_batch_and_get_their_own_outputs(fake_server):
    """8 concurrent clients, different prompts, lengths and stop strings: each gets exactly its
    own output; later requests joined while earlier rows were decoding (at a step > 0)."""
    url, dec, _ = fake_server(step_delay=0.02, per_step=1, max_batch=4)
    cases = [(f"p{i}-" + "xy" * i, 5 + 3 * i, ("y-",) if i % 3 == 0 else ()) for i in range(8)]

    def one(case):
        prompt, n, stop = case
        return (
            client(url)
            .completions.create(model="fake", prompt=prompt, max_tokens=n, stop=list(stop) or None)
            .choices[0]
            .text
        )

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, cases))
    assert outs == [expected(p, n, s)[0] for p, n, s in cases]
    eng = dec.engine_
    assert eng.max_rows == 4  # never more rows than --max-batch
    assert any(running > 0 and step > 0 for _, running, step in eng.added)  # joined mid-decode
    assert (
        len(eng.thread_ids) == 1 and threading.get_ident() not in eng.thread_ids
    )  # one loop thread


def test_queue_full_is_429_with_retry_after(fake_server):
    url, dec, app = fake_server(step_delay=0.05, per_step=1, max_batch=1, max_queue=1)
    results = {}

    def slow(i):
        results[i] = httpx.post(
            f"{url}{COMP}", json={"prompt": f"r{i}", "max_tokens": 20}, timeout=30
        )

    threads = [threading.Thread(target=slow, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.15)  # the first is running, the second waits
    wait_for(lambda: app.state.scheduler.counts() == (1, 1))
    r = httpx.post(f"{url}{COMP}", json={"prompt": "third", "max_tokens": 2}, timeout=30)
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
    for t in threads:
        t.join()
    assert [results[i].json()["choices"][0]["text"] for i in range(2)] == [
        expected(f"r{i}", 20)[0] for i in range(2)
    ]
    assert 'redraft_requests_total{outcome="rejected"} 1.0' in httpx.get(f"{url}/metrics").text


# ---------------------------------------------------------------------------------- disconnects, faults


def test_stream_disconnect_cancels_the_row(fake_server):
    url, dec, app = fake_server(step_delay=0.05, per_step=1)
    other = {}
    t = threading.Thread(
        target=lambda: other.update(
            r=httpx.post(f"{url}{COMP}", json={"prompt": "other", "max_tokens": 40}, timeout=30)
        )
    )
    t.start()
    body = {"prompt": "abandoned", "max_tokens": 60, "stream": True}
    with httpx.stream("POST", f"{url}{COMP}", json=body, timeout=30) as resp:
        it = resp.iter_lines()
        got = [next(it) for _ in range(4)]  # a few events arrived, then the client goes away
    assert any(line.startswith("data: {") for line in got)
    wait_for(lambda: len(dec.engine_.cancelled) == 1)
    rid = dec.engine_.cancelled[0]
    assert rid not in dec.engine_.rows  # left at the next step
    t.join()
    assert other["r"].json()["choices"][0]["text"] == expected("other", 40)[0]
    wait_for(
        lambda: (
            'redraft_requests_total{outcome="cancelled"} 1.0' in httpx.get(f"{url}/metrics").text
        )
    )


def test_non_stream_disconnect_cancels_the_row(fake_server):
    url, dec, _ = fake_server(step_delay=0.05, per_step=1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}{COMP}", json={"prompt": "gone", "max_tokens": 80}, timeout=0.5)
    wait_for(lambda: len(dec.engine_.cancelled) == 1)
    assert not dec.engine_.has_work


def test_a_failing_request_stays_alone(fake_server):
    """engine.add raising for one request answers it alone (500); a step that raises fails the
    rows of that step, the loop builds a new engine and goes on serving."""
    url, dec, app = fake_server(step_delay=0.02, per_step=1)
    with ThreadPoolExecutor(3) as pool:
        good = pool.submit(
            httpx.post, f"{url}{COMP}", json={"prompt": "fine", "max_tokens": 10}, timeout=30
        )
        bad = pool.submit(
            httpx.post, f"{url}{COMP}", json={"prompt": "FAIL_ADD", "max_tokens": 10}, timeout=30
        )
        assert (
            bad.result().status_code == 500
            and bad.result().json()["error"]["type"] == "server_error"
        )
        assert good.result().json()["choices"][0]["text"] == expected("fine", 10)[0]
    r = httpx.post(f"{url}{COMP}", json={"prompt": "FAIL_STEP", "max_tokens": 10}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "decode_error"
    # a streamed request whose step fails after the stream began: an error event, then [DONE]
    with httpx.stream(
        "POST",
        f"{url}{COMP}",
        json={"prompt": "FAIL_STEP", "max_tokens": 10, "stream": True},
        timeout=30,
    ) as resp:
        assert resp.status_code == 200
        lines = sse_lines(resp)
    assert json.loads(lines[0][6:])["error"]["code"] == "decode_error" and lines[1:] == [
        "data: [DONE]"
    ]
    wait_for(lambda: len(dec.engines) == 3)  # a fresh engine after each failed step
    r = httpx.post(f"{url}{COMP}", json={"prompt": "after", "max_tokens": 4}, timeout=30)
    assert r.json()["choices"][0]["text"] == "afte"
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert 'redraft_requests_total{outcome="error"} 3.0' in httpx.get(f"{url}/metrics").text


# ---------------------------------------------------------------------------------- metrics


def test_metrics_count_requests_and_tokens(fake_server):
    url, _, _ = fake_server()
    c = client(url)
    n = [
        c.completions.create(
            model="fake", prompt="m" * (i + 1), max_tokens=3 + i
        ).usage.completion_tokens
        for i in range(3)
    ]
    text = httpx.get(f"{url}/metrics").text
    assert 'redraft_requests_total{outcome="length"} 3.0' in text
    assert f"redraft_generated_tokens_total {float(sum(n))}" in text
    assert "redraft_mean_accepted_length 2.0" in text
    for name in (
        "redraft_tokens_per_second",
        "redraft_queue_depth",
        "redraft_batch_size",
        "redraft_target_calls_total",
        "redraft_time_to_first_token_seconds_bucket",
        "redraft_step_seconds_bucket",
    ):
        assert name in text
    assert "redraft_step_seconds_count 0.0" not in text  # every step observed


# ---------------------------------------------------------------------------------- load benchmark


def test_loadtest_against_two_servers(fake_server, tmp_path, capsys):
    """The load benchmark's figures on known outputs: every token counted, both servers' texts
    compared (identical here: same fake), one row per level and server, ratios against the first."""
    from redraft.bench import loadtest

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(3)))
    url_a, _, _ = fake_server(step_delay=0.01)
    url_b, _, _ = fake_server(step_delay=0.01)
    out = tmp_path / "load.json"
    rc = loadtest.main(
        [
            url_a,
            url_b,
            "--labels",
            "a,b",
            "--concurrency",
            "1,3",
            "--rounds",
            "2",
            "--max-tokens",
            "5",
            "--dataset",
            str(prompts),
            "--prompts",
            "3",
            "--out",
            str(out),
            "--markdown",
            str(tmp_path / "t.md"),
        ]
    )
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["concurrency"], r["label"]) for r in rows] == [
        (1, "a"),
        (1, "b"),
        (3, "a"),
        (3, "b"),
    ]
    assert [r["requests"] for r in rows] == [2, 2, 6, 6] and [r["tokens"] for r in rows] == [
        10,
        10,
        30,
        30,
    ]
    assert all(r["identical"] for r in rows) and rows[0]["ratio"] == 1.0
    assert rows[0]["tree_nodes_per_step"] is None and rows[0]["mean_accepted_length"] == 2.0
    assert rows[0]["ttft_p50_ms"] > 0 and rows[2]["itl_p50_ms"] > 0
    assert math.isnan(rows[0]["prefill_p50_ms"])  # the fake stats have no prefill time: no crash
    md = (tmp_path / "t.md").read_text()
    assert md.count("\n") == 6
    out, err = capsys.readouterr()
    assert out == md  # stdout: the table once, each row once; the progress lines went to stderr
    assert err.count("streams  3") == 2 and "| 3 | b |" not in err


def test_loadtest_repeats_levels_and_summarises_the_ratios(fake_server, tmp_path, capsys):
    """``--repeat 2``: every level twice over both servers, each run's ratio against the first
    server's figure of that run, and a summary row per level and server (mean and range)."""
    from redraft.bench import loadtest

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(2)))
    url_a, _, _ = fake_server(step_delay=0.005)
    url_b, _, _ = fake_server(step_delay=0.04)  # 8x slower steps
    out = tmp_path / "load.json"
    argv = [url_a, url_b, "--labels", "a,b", "--concurrency", "2", "--rounds", "1"]
    argv += ["--max-tokens", "6", "--dataset", str(prompts), "--prompts", "2", "--repeat", "2"]
    assert loadtest.main(argv + ["--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["run"], r["label"]) for r in rows] == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    for a, b in (rows[:2], rows[2:]):
        assert a["ratio"] == 1.0 and b["ratio"] == b["tokens_per_s"] / a["tokens_per_s"] < 0.7
    table = capsys.readouterr().out
    ratios = [rows[1]["ratio"], rows[3]["ratio"]]
    line = next(ln for ln in table.splitlines() if ln.startswith("| 2 | b | 2 |"))
    mean, lo, hi = sum(ratios) / 2, min(ratios), max(ratios)
    assert f"| {mean:.2f} [{lo:.2f}, {hi:.2f}] |" in line and line.endswith("| yes |")
    assert "| 2 | 1 | a |" in table and "| 2 | 2 | b |" in table  # the per-run rows
    assert loadtest.main(argv[:2] + ["--also", "x=--target default"]) == 2  # --also needs --spawn


def test_loadtest_control_is_a_second_reference_server(capsys):
    """``--control`` spawns the reference's own command line once more, after the pair and
    before any ``--also``; without ``--spawn`` it is refused."""
    from redraft.bench import loadtest

    def lines(*extra):
        args = loadtest.build_parser().parse_args(["--spawn", "--target T", *extra])
        return loadtest.spawn_lines(args, [("x", "--target X")])

    assert lines("--control") == [
        ("off", "--target T --no-speculation"),
        ("on", "--target T"),
        ("off2", "--target T --no-speculation"),
        ("x", "--target X"),
    ]
    assert lines("--control", "--scenario", "long-join")[2] == (
        "chunk-off2",
        "--target T --prefill-chunk 0",
    )
    assert [label for label, _ in lines()] == ["off", "on", "x"]
    assert loadtest.main(["http://127.0.0.1:1", "--control"]) == 2
    assert "--control" in capsys.readouterr().err
