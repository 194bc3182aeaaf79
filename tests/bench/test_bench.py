"""redraft-bench: what it refuses before any work, what it writes, the overhead benchmark."""

import json

import pytest

from redraft.bench.cli import main
from redraft.data.prompts import load_prompts


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def tiny_run(capsys, target_dir, prompts, methods, *argv):
    """Two prompts of ``prompts`` x 12 tokens on a tiny target, a given cost curve, no warm-up."""
    return run(
        capsys,
        "--target",
        target_dir,
        "--datasets",
        prompts,
        "--prompts",
        2,
        "--max-new-tokens",
        12,
        "--methods",
        methods,
        "--no-warmup",
        "--cost-curve",
        "1:1,8:1.2,64:2",
        *argv,
    )


def test_list_methods_names_every_method_and_its_needs(capsys):
    code, out, _ = run(capsys, "--list-methods")
    assert code == 0
    names = [line.split()[0] for line in out.splitlines()]
    assert {
        "greedy",
        "context",
        "ngrammys",
        "redrafter",
        "redrafter-auto",
        "aded",
        "hsddw",
        "mix",
        "mix+aded",
    } <= set(names)
    assert "needs ngrams:trigram" in next(
        line for line in out.splitlines() if line.startswith("aded ")
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--methods", "greedy,bogus"], "unknown method 'bogus'"),
        (["--methods", "redrafter"], "needs drafter"),
        (["--methods", "ngrammys"], "needs ngrams:extended"),
        (["--prompts", "0"], "--prompts 0"),
        (["--concurrency", "1,0"], "--concurrency"),
        (["--max-new-tokens", "-1"], "--max-new-tokens -1"),
        (["--budget", "lots"], "budget"),
        (["--max-nodes", "-3"], "max_nodes"),
        (["--redrafter-width", "wide"], "redrafter_width"),
        (["--redrafter-length", "0"], "redrafter_length"),
        (["--acceptance", "maybe"], "acceptance"),
        (["--datasets", ","], "--datasets is empty"),
        (["--cost-curve", "1:2,x"], "cost curve"),
        (["--twin", "lean_walk"], "--twin 'lean_walk' is not KEY=VALUE"),
        (["--twin", "bogus=1"], "bogus"),
        (["--twin", "budget=lots"], "budget"),
    ],
)
def test_requests_that_cannot_run_fail_before_any_work(capsys, tmp_path, argv, words):
    code, out, err = run(capsys, "--target", tmp_path / "no-such-target", *argv)
    assert code == 2, err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_bad_artifacts_and_outputs_fail_before_loading_the_target(capsys, tmp_path):
    missing = tmp_path / "nope"
    code, _, err = run(capsys, "--target", missing, "--ngrams", missing, "--methods", "greedy")
    assert code == 2 and str(missing) in err
    code, _, err = run(capsys, "--target", missing, "--out", tmp_path)  # a directory
    assert code == 2 and "is a directory" in err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = run(capsys, "--target", missing, "--markdown", blocker / "sub" / "x.md")
    assert code == 2 and "cannot create directory" in err


def test_mt_bench_reads_first_turns_and_names_a_missing_file(tmp_path):
    q = tmp_path / "question.jsonl"
    q.write_text(
        "\n".join(
            json.dumps({"question_id": i, "category": "writing", "turns": [f"first {i}", "second"]})
            for i in range(5)
        )
        + "\n"
    )
    prompts = load_prompts(f"mt-bench:{q}", 3)
    assert prompts == [[{"role": "user", "content": f"first {i}"}] for i in range(3)]
    from redraft.errors import DataError

    with pytest.raises(DataError, match="question.jsonl"):
        load_prompts(f"mt-bench:{tmp_path / 'missing.jsonl'}", 3)


def test_a_run_writes_json_markdown_and_a_report(capsys, tiny_target_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps({"prompt": t})
            for t in [
                "The quick brown fox jumps over the lazy dog. The quick brown",
                "def add(a, b):",
            ]
        )
    )
    out, md, rep = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "report"
    code, stdout, err = tiny_run(
        capsys,
        tiny_target_dir,
        prompts,
        "greedy,context,mix",
        "--out",
        out,
        "--markdown",
        md,
        "--report",
        rep,
    )
    assert code == 0, err
    res = json.loads(out.read_text())
    r = res["results"]["p"]
    assert set(r) == {"greedy", "context", "mix"}
    for name in ("context", "mix"):
        assert r[name]["identical_to_ar"] is True  # float32 greedy: token for token
        hist = {int(k): v for k, v in r[name]["accepted_hist"].items()}
        steps = sum(hist.values())
        assert r[name]["mean_accepted_length"] == pytest.approx(
            (sum(k * v for k, v in hist.items()) + steps) / steps, abs=1e-3
        )
        assert len(r[name]["acceptance_per_position"]) == max(hist)
        # where the time went: the parts add up to the wall time (rounded to 10 ms each)
        parts = [r[name][k] for k in ("prefill_time_s", "draft_time_s", "verify_time_s")]
        assert parts[0] > 0  # (to 0.1 ms: a tiny target's prefills take a few ms in all)
        assert sum(parts) + r[name]["other_time_s"] == pytest.approx(r[name]["time_s"], abs=0.03)
        assert r[name]["graphs"]["replays"] == r[name]["graphs"]["eager"] == 0  # CPU: dynamic
    assert r["greedy"]["mean_accepted_length"] == 1.0 and r["greedy"]["speedup_vs_ar"] == 1.0
    assert res["cost_curve_ms"]["given"] is True and res["config"]["decoder"]["budget"] == "auto"
    assert "| mix |" in md.read_text()
    split = [ln for ln in md.read_text().splitlines() if ln.startswith("| mix | ") and " - |" in ln]
    assert len(split) == 1  # the time-split row (no graph column on a CPU)
    index = (rep / "index.md").read_text()
    for png in (
        "speedup.png",
        "acceptance.png",
        "accepted_hist.png",
        "cost_curve.png",
        "drafter_share.png",
    ):
        assert (rep / png).stat().st_size > 1000 and png in index
    # the report can be redrawn from the JSON alone
    rep2 = tmp_path / "again"
    code, _, err = run(capsys, "--from-json", out, "--report", rep2)
    assert code == 0, err
    assert (rep2 / "speedup.png").is_file()


def test_a_twin_decodes_every_prompt_again_with_one_setting_changed(
    capsys, tiny_target_dir, tmp_path
):
    out, prompts = tmp_path / "r.json", tmp_path / "p.jsonl"
    text = "The quick brown fox jumps over the lazy dog. " * 3
    prompts.write_text("\n".join(json.dumps({"prompt": text + t}) for t in ("The", "The quick")))
    code, stdout, err = tiny_run(
        capsys,
        tiny_target_dir,
        prompts,
        "greedy,context",
        "--twin",
        "budget=0",
        "--out",
        out,
    )
    assert code == 0, err
    r = json.loads(out.read_text())["results"]["p"]
    assert list(r) == ["greedy", "greedy [budget=0]", "context", "context [budget=0]"]
    assert all(x["identical_to_ar"] and x["prompts"] == 2 for x in r.values())
    assert r["context"]["tokens_per_call"] > 1.0  # the prompt repeats: context drafts hit
    assert r["context [budget=0]"]["tokens_per_call"] == 1.0  # the twin's setting: no drafts
    assert "| context [budget=0] |" in stdout


def test_a_twin_builds_its_drafters_with_its_setting(tiny_target):
    from redraft.bench.methods import REGISTRY
    from redraft.bench.run import Context, Runner
    from redraft.infer import DecoderConfig

    cfg = DecoderConfig(budget=6)
    ctx = Context(tiny_target, [], [], cfg, {"max_new_tokens": 4})
    main = Runner("context", ctx, REGISTRY["context"])
    twin = Runner("context [ngram_w=3]", ctx, REGISTRY["context"], cfg=cfg.replace(ngram_w=3))
    assert [d.w for d in main.decoder.drafters] == [12]
    assert [d.w for d in twin.decoder.drafters] == [3]
    assert ctx.cfg.ngram_w == 12 and twin.decoder.config.ngram_w == 3


@pytest.mark.parametrize("concurrency", [[1], [1, 4]])
def test_concurrent_passes_get_the_batched_costs_a_server_measures(tiny_target, concurrency):
    """With --concurrency above 1 every speculative decoder gets one measured batched cost (up
    to the largest concurrency), as redraft-serve measures at warm-up; plain greedy none."""
    from redraft.bench.methods import REGISTRY
    from redraft.bench.run import Context, Runner, cost_curve
    from redraft.infer import DecoderConfig

    ctx = Context(tiny_target, [], [], DecoderConfig(), {"max_new_tokens": 4})
    runners = {m: Runner(m, ctx, REGISTRY[m]) for m in ("greedy", "context", "suffix")}
    bench = {"cost_curve_ms": None, "concurrency": concurrency}
    assert cost_curve(runners, bench)["sizes"]
    got = [runners[m].decoder.batch_cost for m in ("context", "suffix")]
    assert runners["greedy"].decoder.batch_cost is None
    if concurrency == [1]:
        assert got == [None, None]
    else:
        assert got[0] is got[1] and got[0].batches == [1, 2, 4]


def test_overhead_benchmark_reports_every_method_and_batch(capsys, tmp_path):
    out = tmp_path / "o.json"
    code, stdout, err = run(
        capsys,
        "--overhead",
        "--overhead-batches",
        "1,2",
        "--overhead-tokens",
        6,
        "--out",
        out,
        "--threads",
        1,
    )
    assert code == 0, err
    res = json.loads(out.read_text())["overhead"]
    assert set(res) == {"greedy", "context-16", "context-64", "ngrammys", "mix-aded", "redrafter"}
    for rows in res.values():
        assert set(rows) == {"batch_1", "batch_2"}
        for r in rows.values():
            assert r["host_ms_per_step"] > 0 and r["forward_ms"] > 0
            assert (
                1 <= r["steps"] <= 6
            )  # at most one step per new token, fewer when drafts are accepted
            assert r["captures"] == r["captures_in_ops"] == 0  # no CUDA graphs on a CPU
    assert res["greedy"]["batch_1"]["steps"] == 5  # plain decoding: one token per step
    assert "host ms/step" in stdout


def test_overhead_benchmark_times_both_host_kernels_in_one_run(tmp_path):
    """``--overhead-kernels jit,numpy``: each method's rows with the compiled host kernels and
    with the numpy code (the baseline, same run); the decodes are the same, only the host time
    differs, and the decoder's own setting is restored after."""
    from redraft.bench.overhead import overhead_benchmark
    from redraft.infer.spec import hostjit

    if not hostjit.ENABLED:
        pytest.skip("numba is not installed or REDRAFT_JIT=0")
    res = overhead_benchmark(
        batches=(1,),
        new_tokens=12,
        repeats=1,
        methods=("context-16", "ngrammys"),
        progress=lambda _: None,
        kernels=("jit", "numpy"),
    )
    rows = res["overhead"]
    assert set(rows) == {"context-16", "context-16 (numpy)", "ngrammys", "ngrammys (numpy)"}
    # a fixed budget verifies the same trees: the same decode, step for step (the auto budget
    # of N-Grammys sizes trees from each decoder's own measured costs)
    assert rows["context-16"]["batch_1"]["steps"] == rows["context-16 (numpy)"]["batch_1"]["steps"]
    assert all(r["batch_1"]["steps"] < 12 for r in rows.values())  # speculation accepted drafts
    assert res["host_kernels"].startswith("numba ") and hostjit.ENABLED


def test_overhead_kernels_are_checked_before_any_work(capsys):
    code, _, err = run(capsys, "--overhead", "--overhead-kernels", "jit,cython")
    assert code != 0 and "--overhead-kernels" in err and "jit,numpy" in err


def test_overhead_rows_count_the_graph_captures_inside_their_timing(tmp_path):
    """A capture in a timed decode is host time and ops of its step: the row says how many."""
    from redraft.bench.overhead import _prompts, make_method, measure, tiny_setup

    target, tables = tiny_setup(tmp_path)
    dec = make_method("greedy", target, tables)
    v = dec.verifier
    v.static, v.graphs = True, True
    v.capture = lambda fn, device, pool: (type("G", (), {"replay": lambda self: fn()})(), fn())
    prompts = _prompts(target, 1)
    first = measure(dec, prompts, 6)
    again = measure(dec, prompts, 6)
    assert first["captures"] >= 1  # the first plain step's shape, seen twice in a row
    assert first["captures"] + again["captures"] == v.graph_stats["captures"]
    assert v.graph_stats["replays"] > 0


def test_overhead_methods_time_speculative_steps_only(tmp_path):
    """The guard would swap losing speculative steps for plain ones and hide their cost."""
    from redraft.bench.overhead import make_method, tiny_setup

    target, tables = tiny_setup(tmp_path)
    for name in ("ngrammys", "mix-aded"):
        dec = make_method(name, target, tables)
        assert dec.drafters and dec.config.budget == "auto" and not dec.guard.enabled
        assert all(dec.guard.speculate(8) for _ in range(100))


def _prompts_file(tmp_path, texts):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": t}) for t in texts))
    return p


PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "def add(a, b):",
    "one two three one two",
]


def test_a_failing_method_keeps_the_others_and_the_file_holds_what_was_measured(
    capsys, tiny_target_dir, tmp_path, monkeypatch
):
    """A method that raises (e.g. a CUDA-graph capture assert at the first speculative
    step) costs its own rows only; the JSON and Markdown hold every method's figures."""
    from redraft.bench import run as bench_run

    real, calls = bench_run.Runner.run, {"n": 0}

    def flaky(self, ids):
        if self.name == "context":
            calls["n"] += 1
            if calls["n"] == 2:  # its second prompt
                raise RuntimeError("CUDACachingAllocator.cpp:2799 INTERNAL ASSERT FAILED")
        return real(self, ids)

    monkeypatch.setattr(bench_run.Runner, "run", flaky)
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    code, _, err = run(
        capsys,
        "--target",
        tiny_target_dir,
        "--datasets",
        _prompts_file(tmp_path, PROMPTS),
        "--prompts",
        3,
        "--max-new-tokens",
        8,
        "--methods",
        "greedy,context,mix",
        "--no-warmup",
        "--cost-curve",
        "1:1,64:2",
        "--out",
        out,
        "--markdown",
        md,
        "--report",
        tmp_path / "rep",
    )
    assert code == 1 and "method 'context' failed on" in err and "INTERNAL ASSERT" in err, err
    res = json.loads(out.read_text())
    assert res["complete"] is True
    r = res["results"]["p"]
    assert (
        r["greedy"]["prompts"] == 3
        and r["mix"]["prompts"] == 3
        and r["mix"]["identical_to_ar"] is True
    )
    assert r["context"]["prompts"] == 1 and "INTERNAL ASSERT" in r["context"]["error"]
    assert r["context"]["identical_prompts"] == "1/3" and r["context"]["identical_to_ar"] is False
    assert r["context"]["new_tokens"] > 0  # its first prompt was measured and kept
    assert "| context |" in md.read_text() and "failed after 1 prompt(s)" in md.read_text()
    assert "failed after 1 prompt(s)" in (tmp_path / "rep" / "index.md").read_text()


def test_a_run_stopped_midway_keeps_every_finished_prompt(
    capsys, tiny_target_dir, tmp_path, monkeypatch
):
    """The runner stops a step at its time limit: the files hold the prompts finished before."""
    from redraft.bench import run as bench_run

    real, calls = bench_run.Runner.run, {"n": 0}

    def flaky(self, ids):
        if self.name == "greedy":
            calls["n"] += 1
            if calls["n"] == 2:  # stopped while decoding the second prompt
                raise KeyboardInterrupt
        return real(self, ids)

    monkeypatch.setattr(bench_run.Runner, "run", flaky)
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    code, _, err = run(
        capsys,
        "--target",
        tiny_target_dir,
        "--datasets",
        _prompts_file(tmp_path, PROMPTS),
        "--prompts",
        3,
        "--max-new-tokens",
        8,
        "--methods",
        "greedy,context",
        "--no-warmup",
        "--cost-curve",
        "1:1,64:2",
        "--out",
        out,
        "--markdown",
        md,
    )
    assert code == 130, err
    res = json.loads(out.read_text())
    assert res["complete"] is False
    r = res["results"]["p"]
    assert (
        r["greedy"]["prompts"] == 1
        and r["context"]["prompts"] == 1
        and r["context"]["identical_to_ar"] is True
    )
    assert r["greedy"]["new_tokens"] == 8 and r["greedy"]["speedup_vs_ar"] == 1.0
    assert "| greedy |" in md.read_text() and "| context |" in md.read_text()
    assert not list(tmp_path.glob("*.tmp*"))  # atomic writes leave nothing behind
    code, _, err = run(
        capsys, "--from-json", out, "--report", tmp_path / "rep"
    )  # its plots say it is partial
    assert code == 0, err
    assert "**Partial run**" in (tmp_path / "rep" / "index.md").read_text()


def test_a_prompt_longer_than_the_context_is_skipped_with_a_note(capsys, tiny_target_dir, tmp_path):
    long = " ".join(f"w{i}" for i in range(1500))  # the tiny target's context is 1024 tokens
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    code, _, err = run(
        capsys,
        "--target",
        tiny_target_dir,
        "--datasets",
        _prompts_file(tmp_path, [PROMPTS[0], long, PROMPTS[1]]),
        "--prompts",
        3,
        "--max-new-tokens",
        8,
        "--methods",
        "greedy,context",
        "--no-warmup",
        "--cost-curve",
        "1:1,64:2",
        "--out",
        out,
        "--markdown",
        md,
    )
    assert code == 0, err
    res = json.loads(out.read_text())
    (skip,) = res["skipped_prompts"]["p"]
    assert skip["prompt"] == 1 and skip["tokens"] + 8 > 1024 and skip["context"] == 1024
    assert (
        res["results"]["p"]["greedy"]["prompts"] == 2
        and res["results"]["p"]["context"]["identical_to_ar"]
    )
    assert "1 prompt(s) skipped" in md.read_text() and "1 of 3 prompts skipped" in err
    # every prompt too long: one line naming the dataset and what to do
    code, _, err = run(
        capsys,
        "--target",
        tiny_target_dir,
        "--datasets",
        _prompts_file(tmp_path, [long]),
        "--prompts",
        1,
        "--max-new-tokens",
        8,
        "--methods",
        "greedy",
        "--no-warmup",
    )
    last = err.strip().splitlines()[-1]  # (the lines before it are the weights' loading bar)
    assert (
        code == 2
        and last.startswith("redraft-bench: error: dataset")
        and "every prompt (1) is longer" in last
    )


def test_the_redrafter_overhead_row_runs_its_beam_search_every_step(tmp_path):
    """The ``redrafter`` row is a random head's beam search + tree each step: a step proposes
    beams (the drafter counts its steps) and the output is plain greedy's."""
    from redraft.bench.overhead import _prompts, make_method, measure, tiny_setup
    from redraft.infer.decoder import plain_greedy

    target, tables = tiny_setup(tmp_path)
    dec = make_method("redrafter", target, tables)
    prompts = _prompts(target, 2)
    r = measure(dec, prompts, 12)
    dr = dec.drafters[0]
    assert dr.name == "redrafter" and dr.auto
    assert sum(dr.plans.values()) == r["steps"] >= 6  # one beam search per step
    dec.eos = set(target.eos_token_ids)
    ref = plain_greedy(target, prompts, max_new_tokens=12)
    assert [g.tokens for g in dec.generate(prompts, max_new_tokens=12)] == [g.tokens for g in ref]


def test_first_use_captures_are_left_out_of_the_steady_speedup():
    """On CUDA a short run pays each graph shape's capture once (up to a third of a method's time
    in a run of a few prompts); the table also gives the speedup without those seconds,
    on both sides."""
    from redraft.bench.run import _Agg, markdown, summarise
    from redraft.infer.stats import RequestStats

    def agg(times, tokens, captures, capture_s):
        a = _Agg(RequestStats(target_calls=0), times=times, tokens=tokens)
        a.stats.new_tokens, a.stats.target_calls = sum(tokens), sum(tokens)
        a.graphs = {"replays": 10, "eager": 1, "captures": captures, "capture_s": capture_s}
        return a

    res = summarise(
        {
            "greedy": agg([1.0, 1.0], [100, 100], 2, 0.2),
            "context": agg([1.5, 1.0], [100, 100], 6, 1.0),
        }
    )
    assert res["context"]["speedup_vs_ar"] == pytest.approx(0.8)  # 200/2.5 against 200/2.0
    assert res["context"]["speedup_without_captures"] == pytest.approx(1.8 / 1.5)  # 1.5 s vs 1.8 s
    bench = {"target": "t", "dtype": "bfloat16", "max_new_tokens": 128}
    md = markdown({"chat": res}, bench, "gpu")
    assert "| speedup vs AR | without captures |" in md
    assert "| context | 1.00 | 1.00 | 80.0 | 0.80x | 1.20x |" in md
    no_captures = {k: {**v, "graphs": {**v["graphs"], "captures": 0}} for k, v in res.items()}
    assert "without captures" not in markdown({"chat": no_captures}, bench, "cpu")


def test_the_gate_view_sums_over_prompts():
    """Per method: the share of verify steps each drafter was called in and its exclusive gain
    per side-by-side step, summed over the prompts' stats (what tells a GPU run why a mix
    follows one drafter)."""
    from collections import Counter

    from redraft.bench.run import _Agg, summarise
    from redraft.infer.stats import RequestStats

    def stats(steps, calls, excl, joint):
        return RequestStats(
            new_tokens=2 * steps,
            target_calls=steps + 1,
            accepted_hist=Counter({1: steps}),
            drafter_calls=Counter(calls),
            drafter_exclusive=Counter(excl),
            joint_steps=joint,
            drafter_accepted=Counter({k: 3 * v // 4 for k, v in calls.items()}),
        )

    aggs = {}
    for name in ("greedy", "mix"):
        aggs[name] = _Agg(RequestStats(target_calls=0))
    for st in (
        stats(10, {"head": 10, "ngrammys": 4}, {"head": 3, "ngrammys": 1}, 4),
        stats(30, {"head": 30, "ngrammys": 6}, {"head": 5}, 6),
    ):
        aggs["greedy"].add(1.0, [0] * st.new_tokens, None, RequestStats(new_tokens=st.new_tokens))
        aggs["mix"].add(0.5, [0] * st.new_tokens, None, st)
    res = summarise(aggs)["mix"]
    assert res["drafter_called"] == {"head": 1.0, "ngrammys": 0.25}  # 40 and 10 of 40 steps
    assert res["drafter_exclusive_per_joint_step"] == {"head": 0.8, "ngrammys": 0.1}  # of 10
    assert res["joint_steps"] == 10
    from redraft.bench.run import drafter_split

    rows = drafter_split({"greedy": summarise(aggs)["greedy"], "mix": res})
    assert rows[2:] == [  # accepted: head 7 + 22 of 40 tokens, ngrammys 3 + 4
        "| mix | head | 0.725 | 1.000 | 0.800 |",
        "| mix | ngrammys | 0.175 | 0.250 | 0.100 |",
    ]


def test_timers_sum_the_wrapped_calls_and_start_again():
    import time

    from redraft.bench.overhead import Timers

    class Work:
        def run(self, secs):
            time.sleep(secs)
            return secs

    w, timers = Work(), Timers()
    timers.wrap(w, "run")
    timers.wrap(Work, "run", "class")  # a class too: instances made later are timed
    assert w.run(0.01) == 0.01 and w.run(0.02) == 0.02
    got = timers.take()
    assert got["run"] >= 0.03 and "class" not in got  # the instance's own attribute wins
    assert Work().run(0.01) == 0.01 and set(timers.take()) == {"class"}
    assert timers.take() == {}


def test_vllm_methods_need_vllm_and_say_how(capsys, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a)
    )
    code, _, err = run(capsys, "--target", tmp_path / "t", "--methods", "greedy,vllm-ngram")
    assert code == 2 and "needs vllm" in err and "make vllm-venv" in err


def test_concurrent_requests_and_the_run_as_data(capsys, tiny_target_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    texts = ["The quick brown fox. The quick brown", "def add(a, b):", "a b c a b c a b", "x y z"]
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in texts))
    results = tmp_path / "results"
    code, stdout, err = run(
        capsys,
        "--target",
        tiny_target_dir,
        "--datasets",
        prompts,
        "--prompts",
        4,
        "--max-new-tokens",
        10,
        "--methods",
        "greedy,context",
        "--no-warmup",
        "--cost-curve",
        "1:1,8:1.2,64:2",
        "--concurrency",
        "1,3",
        "--results-dir",
        results,
    )
    assert code == 0, err
    files = sorted(results.iterdir())
    assert [f.suffix for f in files] == [".json", ".md"] and files[0].stem == files[1].stem
    data = json.loads(files[0].read_text())
    meta = data["meta"]
    assert (
        meta["command"].startswith("redraft-bench --target ")
        and "--concurrency 1,3" in meta["command"]
    )
    assert (
        meta["versions"]["torch"] and meta["machine"]["cores"] >= 1 and meta["date"][:4] >= "2025"
    )
    conc = data["concurrent"]["p"]["3"]
    assert set(conc) == {"greedy", "context"}
    # 3 at a time, then 1: every prompt decoded, float32 rows equal to plain decoding's
    assert conc["context"]["identical_to_plain"] == "4/4" and conc["greedy"]["speedup_vs_ar"] == 1.0
    md = files[1].read_text()
    assert md.startswith("# redraft-bench: ") and "- commit: " in md and "| 3 req tok/s |" in md


class _Engines:
    """Fake vLLM engines that log which engines are alive whenever any method decodes."""

    def __init__(self):
        self.alive, self.log = set(), []
        self.forgot = []  # (redraft method, decodes it had logged before) at each forget()

    def runner(self, name: str, peer: bool):
        from types import SimpleNamespace

        from redraft.infer.stats import RequestStats

        eng = self

        class Peer:
            def start(self):
                eng.alive.add(name)

            def close(self):
                eng.alive.discard(name)

            def run(self, ids):
                self.start()
                return self.run_batch([ids])[0], RequestStats(new_tokens=2, target_calls=2)

            def run_batch(self, prompts):
                self.start()
                eng.log.append((name, frozenset(eng.alive)))
                return [[p[0], p[0] + 1] for p in prompts]

        def generate(prompts, max_new_tokens):
            eng.log.append((name, frozenset(eng.alive)))
            return [SimpleNamespace(tokens=[p[0], p[0] + 1]) for p in prompts]

        r = SimpleNamespace(name=name, peer=Peer() if peer else None)
        if peer:
            r.decoder, r.run = None, r.peer.run
        else:
            r.decoder = SimpleNamespace(
                generate=generate,
                verifier=SimpleNamespace(graph_stats={}),
                forget=lambda: eng.forgot.append((name, len(eng.log))),
            )
            r.run = lambda ids: (
                generate([ids], 0)[0].tokens,
                RequestStats(new_tokens=2, target_calls=2),
            )
        return r


@pytest.mark.parametrize("engines", ["one", "all"])
def test_vllm_engines_one_keeps_a_single_engine_alive_and_none_while_redraft_decodes(engines):
    from redraft.bench.concurrent import run_concurrent
    from redraft.bench.run import run_dataset

    e = _Engines()
    runners = {
        "greedy": e.runner("greedy", False),
        "vllm": e.runner("vllm", True),
        "context": e.runner("context", False),
        "vllm-ngram": e.runner("vllm-ngram", True),
    }
    bench = {"warmup": False, "vllm_engines": engines, "max_new_tokens": 2}
    prompts = [[1], [5], [9]]
    seen = []
    res = run_dataset(runners, prompts, bench, "p", on_prompt=seen.append)
    assert all(res[m]["identical_prompts"] == "3/3" for m in runners)
    assert res["context"]["speedup_vs_vllm"] > 0 and res["context"]["identical_to_vllm"] == "3/3"
    if engines == "one":  # before vLLM's pass no figure against it (not a 0.00x)
        assert (
            "speedup_vs_vllm" not in seen[2]["context"] and "speedup_vs_vllm" in seen[3]["context"]
        )
    order = [name for name, _ in e.log]
    if engines == "one":
        # redraft's methods prompt by prompt with no engine alive, then each engine on its own
        assert order == ["greedy", "context"] * 3 + ["vllm"] * 3 + ["vllm-ngram"] * 3
        assert all(alive == ({n} if n.startswith("vllm") else set()) for n, alive in e.log)
        assert not e.alive  # every engine shut down after its pass
    else:
        assert order == ["greedy", "vllm", "context", "vllm-ngram"] * 3
        assert e.log[-1][1] == {"vllm", "vllm-ngram"}
    # redraft's decoders start the pass empty, as vLLM's engines do: before their first prompt
    assert e.forgot == [("greedy", 0), ("context", 0)]
    e.log.clear()
    e.forgot.clear()
    conc = run_concurrent(runners, prompts, bench, 2)
    assert e.forgot == [("greedy", 0), ("context", 0)]  # and every pass at a concurrency
    assert conc["vllm-ngram"]["identical_to_plain"] == "3/3"
    if engines == "one":
        assert [n for n, _ in e.log] == ["greedy", "context"] * 2 + ["vllm"] * 2 + [
            "vllm-ngram"
        ] * 2
        assert all(alive == ({n} if n.startswith("vllm") else set()) for n, alive in e.log)
