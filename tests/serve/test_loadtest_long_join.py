"""The load benchmark's long-join scenario (chunked prefill): streams decode, one long prompt
joins them, and the figures split the streams' inter-token gaps at the join."""

import json

from redraft.bench import loadtest


def test_long_join_scenario_reports_the_gaps_around_the_join(fake_server, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"prompt number {i}"}) + "\n" for i in range(3))
    )
    url, _, _ = fake_server(step_delay=0.01, per_step=1)
    out = tmp_path / "long.json"
    rc = loadtest.main(
        [
            url,
            "--labels",
            "a",
            "--scenario",
            "long-join",
            "--concurrency",
            "2",
            "--max-tokens",
            "6",
            "--long-tokens",
            "15",
            "--join-after",
            "0.3",
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
    [row] = json.loads(out.read_text())["rows"]
    assert row["label"] == "a" and row["prompt_tokens"] > 0
    assert row["itl_p50_before_ms"] > 0 and row["long_ttft_ms"] > 0 and row["gaps_during"] > 0
    assert row["p99_over_median"] == row["itl_p99_during_ms"] / row["itl_p50_before_ms"]
    assert (tmp_path / "t.md").read_text().count("\n") == 3
    # the server's own step times from its /metrics histogram (the fake's steps take 10 ms)
    for key in ("step_p50_before_ms", "step_p50_during_ms", "step_p99_during_ms"):
        assert 10 <= row[key] < 60, (key, row[key])


def test_a_quantile_between_two_scrapes_is_the_bucket_it_falls_in():
    before = {0.01: 5.0, 0.02: 5.0, 0.04: 5.0, float("inf"): 5.0}
    after = {0.01: 15.0, 0.02: 105.0, 0.04: 106.0, float("inf"): 106.0}  # 10, 90, 1 new
    assert loadtest.bucket_quantile(before, after, 0.05) == 10.0
    assert loadtest.bucket_quantile(before, after, 0.5) == 20.0
    assert loadtest.bucket_quantile(before, after, 0.995) == 40.0
    nan = loadtest.bucket_quantile(after, after, 0.5)
    assert nan != nan and loadtest.bucket_quantile({}, {}, 0.5) != 0


def test_the_long_prompt_has_about_the_tokens_asked_for():
    text = loadtest.long_prompt_text(["abc " * 10, [{"role": "user", "content": "hello"}]], 1000)
    assert len(text) == 4000 and "hello" in text
