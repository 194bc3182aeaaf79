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
    monkeypatch.setattr(demo, "compare", lambda *a: called.append("compare"))
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
