"""redraft-demo refuses bad values at once (one line naming the flag, exit 2), before any stage runs."""

import pytest

from redraft import demo


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--prompts", "0", "--skip-train"], "--prompts 0"),
        (["--prompts", "-3"], "--prompts -3"),
        (["--train-minutes", "-1"], "--train-minutes -1"),
        (["--train-minutes", "0"], "--train-minutes 0"),
        (["--train-minutes", "nan"], "--train-minutes nan"),
        (["--max-new-tokens", "0", "--skip-train"], "--max-new-tokens 0"),
        (["--dtypes", "float32,int4", "--skip-train"], "--dtypes"),
        (["--threads", "0"], "--threads 0"),
    ],
)
def test_bad_values_are_refused_at_once(argv, flag, capsys, monkeypatch, tmp_path):
    def no_stage(*a, **k):
        raise AssertionError("a stage ran before the arguments were checked")

    monkeypatch.setattr(demo, "build_ngrams", no_stage)
    monkeypatch.setattr(demo, "train_head", no_stage)
    with pytest.raises(SystemExit) as info:
        demo.main([*argv, "--output-root", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("redraft-demo: error: ") and flag in err[0], err
    assert "--max-time-minutes" not in err[0]  # the demo's own flag, not the trainer's


def test_train_minutes_is_not_checked_with_skip_train(monkeypatch, tmp_path):
    called = []
    monkeypatch.setattr(demo, "build_ngrams", lambda *a: called.append("ngrams") or tmp_path)
    summary = {"speedup": 1.5, "tau": 2.0, "identical": "4/4"}
    monkeypatch.setattr(demo, "compare", lambda *a: called.append("compare") or summary)
    monkeypatch.setattr("redraft.models.load_target", lambda *a, **k: None)
    assert (
        demo.main(
            [
                "--skip-train",
                "--train-minutes",
                "-1",
                "--dtypes",
                "float32",
                "--output-root",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert called == ["ngrams", "compare"]


def test_compare_explains_each_difference_with_the_float32_referee(
    tiny_target, monkeypatch, capsys
):
    """Where the unified decoder's output differs from plain greedy (bf16 near-ties), the demo
    prints where and what the float32 target thinks of the two tokens; a difference at a token
    the target clearly did not prefer is called out as an error."""
    import dataclasses

    import torch

    from redraft.infer import decoder as dec_mod

    chats = [[{"role": "user", "content": t}] for t in ("hello there", "count to five")]
    monkeypatch.setattr("redraft.data.heldout_prompts", lambda spec, n: chats[:n])

    class Flipping:  # plain greedy, except prompt 1's token 3 becomes the least likely one
        drafters = ()

        def generate(self, msgs, max_new_tokens):
            g = dec_mod.plain_greedy(tiny_target, msgs, max_new_tokens=max_new_tokens)[0]
            if msgs is chats[1] and max_new_tokens > 8:
                ids = tiny_target.chat_ids(msgs) + g.tokens[:3]
                with torch.no_grad():
                    worst = int(tiny_target.model(torch.tensor([ids])).logits[0, -1].argmin())
                g = dataclasses.replace(g, tokens=g.tokens[:3] + [worst] + g.tokens[4:])
            return [g]

    monkeypatch.setattr("redraft.infer.load_decoder", lambda *a, **k: Flipping())
    summary = demo.compare(tiny_target, [], [], 2, 12, referee=lambda: tiny_target)
    out = capsys.readouterr().out
    assert summary["identical"] == "1/2" and summary["near_ties"] == "0/1"
    assert "prompt 1: first differs at token 3" in out and "NOT a near-tie" in out
    assert "prompt 0:" not in out.split("each difference")[1]


def _stub_stages(monkeypatch, tmp_path):
    """Every stage replaced by a recorder: (what ran, with which arguments)."""
    calls = []
    monkeypatch.setattr(demo, "build_ngrams", lambda *a: tmp_path / "ngrams")

    def train_head(target, out, recipe, minutes, retrain, stages, over=None):
        calls.append((out.name, recipe, minutes, over))
        stages.add("head", None, "stub")
        return out

    monkeypatch.setattr(demo, "train_head", train_head)
    monkeypatch.setattr(demo, "print_head_metrics", lambda run: None)
    summary = {"speedup": 1.5, "tau": 2.0, "identical": "4/4"}
    monkeypatch.setattr(demo, "compare", lambda *a: summary)
    monkeypatch.setattr("redraft.models.load_target", lambda *a, **k: None)
    return calls


@pytest.mark.parametrize(
    "flags,run,recipe",
    [([], "redrafter-smollm2", "demo"), (["--full"], "redrafter-smollm2-full", "demo-full")],
)
def test_full_selects_the_quality_recipe_and_its_own_head(
    flags, run, recipe, monkeypatch, tmp_path, capsys
):
    """The quick and the quality head live apart (neither is reused for the other); the
    training budget is the recipe's unless --train-minutes is given."""
    from redraft.train.config import load_recipe

    calls = _stub_stages(monkeypatch, tmp_path)
    argv = [*flags, "--dtypes", "float32", "--output-root", str(tmp_path)]
    assert demo.main(argv) == 0
    assert demo.main([*argv, "--train-minutes", "1.5"]) == 0
    assert demo.main([*argv, "--threads", "1"]) == 0
    assert calls == [
        (run, recipe, load_recipe(recipe)["max_time_minutes"], None),
        (run, recipe, 1.5, None),
        (run, recipe, load_recipe(recipe)["max_time_minutes"], {"threads": 1}),
    ]
    out = capsys.readouterr().out
    assert f"recipe {recipe}:" in out


def test_the_closing_table_has_a_row_per_stage_and_the_total(monkeypatch, tmp_path, capsys):
    _stub_stages(monkeypatch, tmp_path)
    assert demo.main(["--dtypes", "float32,bfloat16", "--output-root", str(tmp_path)]) == 0
    table = capsys.readouterr().out.split("=== summary ===")[1].strip().splitlines()
    assert table[0].split() == ["stage", "minutes", "result"]
    stages = [line.split("  ")[0].strip() for line in table[1:]]
    assert stages == ["n-gram tables", "head", "decoding, float32", "decoding, bfloat16", "total"]
    assert table[2].split()[1] == "-"  # a reused head took no time
    assert "1.50x plain greedy, tau 2.00 tokens per target call, outputs identical 4/4" in table[3]
    assert table[-1].split()[1].replace(".", "").isdigit()


def test_stages_table_reports_minutes_and_reuse():
    s = demo.Stages()
    s.add("self-distilled replies", 150.0, "400 conversations")
    s.add("head", None, "reused")
    lines = s.table().splitlines()
    assert lines[1].split() == ["self-distilled", "replies", "2.5", "400", "conversations"]
    assert lines[2].split()[:3] == ["head", "-", "reused"]
    assert lines[3].startswith("total ")


def test_the_quick_recipe_is_the_quality_recipe_made_smaller():
    """demo.yaml differs from demo-full.yaml only in its size (replies, their batch, minutes);
    what the head is and how it learns is the same."""
    from redraft.train.config import load_recipe

    quick, full = load_recipe("demo"), load_recipe("demo-full")
    size = {"distill_limit", "distill_max_new_tokens", "distill_batch_size", "max_time_minutes"}
    assert set(quick) == set(full)
    assert {k for k in quick if quick[k] != full[k]} == size
    assert quick["distill_limit"] < full["distill_limit"]
    assert quick["distill_max_new_tokens"] <= full["distill_max_new_tokens"]
    assert quick["max_time_minutes"] < full["max_time_minutes"]
    assert quick["self_distill"] and quick["schedule_by_time"]


def test_help_gives_each_recipes_size_from_its_file(capsys):
    from redraft.train.config import load_recipe

    with pytest.raises(SystemExit):
        demo.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("demo", "demo-full"):
        r = load_recipe(name)
        assert (
            f"train/recipes/{name}.yaml: {r['distill_limit']:,} ShareGPT first turns answered by "
            f"the target, replies of at most {r['distill_max_new_tokens']} tokens, "
            f"{r['max_time_minutes']:g} minutes of training" in text
        ), name


@pytest.mark.parametrize("load,says", [(0.3, False), (1.2, True)])
def test_a_busy_cpu_is_named_with_the_flag_that_helps(load, says, monkeypatch, capsys):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (load, load, load))
    demo.busy_cpu_hint()
    out = capsys.readouterr().out
    assert ("--threads 1" in out and f"load average {load:.1f} on 2 cores" in out) == says, out
