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
