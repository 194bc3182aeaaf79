"""redraft-distill-data: the target's own replies, batched, resumable without duplicates."""

import json

import pytest
from data_helpers import CHATS, write_jsonl

from redraft.data import iter_records
from redraft.data.distill import main
from redraft.data.regenerate import _prompt_ids
from redraft.data.replies import generate_replies


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def run(tiny_target_dir, data, out, *extra):
    return main(
        [
            "--target",
            str(tiny_target_dir),
            "--data",
            data,
            "--output",
            str(out),
            "--max-new-tokens",
            "5",
            "--batch-size",
            "3",
            "--no-progress",
            *extra,
        ]
    )


def one_line(err: str) -> str:
    """The CLI's own stderr (transformers' weight-loading bar aside): exactly one line."""
    ours = [line for line in err.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(ours) == 1 and "Traceback" not in err, err
    return ours[0]


def test_batched_left_padded_generation_equals_one_by_one(tiny_target):
    tok = tiny_target.tokenizer
    prompts = [
        _prompt_ids(tok, [{"role": "user", "content": text}])
        for text in (
            "Hi",
            "Speculative decoding drafts tokens and the target verifies them",
            "print(x)",
        )
    ]
    assert len({len(p) for p in prompts}) == 3  # really padded
    batched = generate_replies(tiny_target, prompts, max_new_tokens=6, temperature=0.0, top_p=1.0)
    for p, got in zip(prompts, batched):
        alone = generate_replies(tiny_target, [p], max_new_tokens=6, temperature=0.0, top_p=1.0)[0]
        assert got == alone
        assert len(got[0]) <= 6 and not set(got[0]) & set(tiny_target.eos_token_ids)


def test_distill_writes_sharegpt_and_resumes_without_duplicates(tiny_target_dir, tmp_path):
    data = f"sharegpt:{write_jsonl(tmp_path / 'src.jsonl', CHATS)}"
    out = tmp_path / "out" / "distilled.jsonl"
    assert run(tiny_target_dir, data, out, "--limit", "2") == 0
    first = out.read_text()
    assert [r["id"] for r in lines(out)] == ["sg-0", "sg-1"]

    assert run(tiny_target_dir, data, out) == 0  # resume: only the missing ids are added
    rows = lines(out)
    assert sorted(r["id"] for r in rows) == ["sg-0", "sg-1", "sg-2", "sg-3"]  # each once
    assert out.read_text().startswith(first)

    assert run(tiny_target_dir, data, out) == 0  # nothing left to do: the file is unchanged
    assert out.read_text() == "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)

    # every output is a valid source; system and user turns are kept, replies are the target's
    src = {r.id: r for r in iter_records(data)}
    for rec in iter_records(f"sharegpt:{out}"):
        ours = [m for m in rec.messages if m["role"] != "assistant"]
        theirs = [m for m in src[rec.id].messages if m["role"] != "assistant"]
        assert ours == theirs[: len(ours)] and ours[-1]["role"] == "user"
        assert rec.messages[-1]["role"] == "assistant"
        replies = {m["content"] for m in rec.messages if m["role"] == "assistant"}
        assert not replies & {
            m["content"] for m in src[rec.id].messages if m["role"] == "assistant"
        }
    assert rows[0]["distilled_with"]["max_new_tokens"] == 5


def test_distill_recovers_from_a_line_cut_by_a_crash(tiny_target_dir, tmp_path):
    data = f"sharegpt:{write_jsonl(tmp_path / 'src.jsonl', CHATS)}"
    out = tmp_path / "distilled.jsonl"
    assert run(tiny_target_dir, data, out, "--limit", "1") == 0
    with open(out, "a") as f:
        f.write('{"id": "sg-1", "conversations": [{"from": "hu')  # interrupted mid-write
    assert run(tiny_target_dir, data, out, "--limit", "2") == 0
    assert [r["id"] for r in lines(out)] == ["sg-0", "sg-1"]


def test_greedy_distillation_is_deterministic(tiny_target_dir, tmp_path):
    data = f"sharegpt:{write_jsonl(tmp_path / 'src.jsonl', CHATS)}"
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert run(tiny_target_dir, data, a, "--limit", "3") == 0
    assert (
        run(tiny_target_dir, data, b, "--limit", "3", "--batch-size", "1", "--sort-window", "1")
        == 0
    )
    by_id = lambda path: {r["id"]: r for r in lines(path)}  # noqa: E731
    assert (
        by_id(a) == by_id(b) and len(by_id(a)) == 3
    )  # batching and sorting do not change greedy replies
    assert [r["id"] for r in lines(b)] == [
        "sg-0",
        "sg-1",
        "sg-2",
    ]  # --sort-window 1 keeps the source order


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--data", "nonsense:spec"], "Unknown data source 'nonsense:spec'"),
        (["--data", "default-code"], "holds documents (code files), not conversations"),
        (["--data", "code-dir:/tmp?glob=*.py"], "not conversations"),
        (
            ["--temperature", "-1"],
            "--temperature -1.0 is out of range: it must be a finite number >= 0",
        ),
        (["--temperature", "nan"], "--temperature nan is out of range"),
        (["--top-p", "0"], "--top-p 0.0 is out of range: it must be in (0, 1]"),
        (["--limit", "-5"], "--limit -5 is out of range: it must be at least 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0 is out of range"),
        (
            ["--heldout-fraction", "1.5"],
            "--heldout-fraction 1.5 is out of range: it must be in (0, 1)",
        ),
        (["--dtype", "int8"], "unknown dtype 'int8'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_before_the_model_loads(
    tiny_target_dir, tmp_path, capsys, monkeypatch, extra, message
):
    monkeypatch.setattr("redraft.models.load_target", lambda *a, **kw: pytest.fail("model loaded"))
    out = tmp_path / "o.jsonl"
    assert run(tiny_target_dir, "default-chat", out, *extra) == 2
    line = one_line(capsys.readouterr().err)
    assert message in line and line.startswith("redraft-distill-data: error:")
    assert not out.exists()


def test_output_that_is_a_directory_fails_before_any_work(
    tiny_target_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr("redraft.models.load_target", lambda *a, **kw: pytest.fail("model loaded"))
    assert run(tiny_target_dir, "default-chat", tmp_path) == 2
    assert f"--output {tmp_path} is a directory" in one_line(capsys.readouterr().err)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_without_cuda_is_one_line(tiny_target_dir, tmp_path, capsys):
    assert run(tiny_target_dir, "default-chat", tmp_path / "o.jsonl", "--device", "cuda") == 2
    assert "--device cpu" in one_line(capsys.readouterr().err)


def test_a_source_of_documents_only_says_why_nothing_was_written(tiny_target_dir, tmp_path, capsys):
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"content": "def f():\n    return 1\n"}] * 3)
    out = tmp_path / "o.jsonl"
    assert run(tiny_target_dir, str(docs), out) == 2  # a bare path: the kind shows only when read
    line = one_line(capsys.readouterr().err)
    assert "holds no conversation to distill (3 document records" in line
    assert not out.exists()


def test_an_output_that_is_not_ours_is_refused(tiny_target_dir, tmp_path, capsys):
    data = f"sharegpt:{write_jsonl(tmp_path / 'src.jsonl', CHATS)}"
    out = write_jsonl(tmp_path / "other.jsonl", [[1, 2]])
    assert run(tiny_target_dir, data, out) == 2
    assert "line 1 is a JSON value without an 'id'" in one_line(capsys.readouterr().err)


def test_cli_help_prints_each_default_once_and_bare_booleans(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-new-tokens" in text and "--progress, --no-progress" in text
    assert text.count("(default: 256)") == 1 and "(default: None)" not in text
    assert "(default: (default" not in text


def test_cli_module_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, redraft.data.distill; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_sampled_distillation_is_seeded(tiny_target_dir, tmp_path):
    data = f"sharegpt:{write_jsonl(tmp_path / 'src.jsonl', CHATS)}"
    a, b, c = (tmp_path / f"{x}.jsonl" for x in "abc")
    for path in (a, b):
        assert (
            run(tiny_target_dir, data, path, "--limit", "2", "--temperature", "1.0", "--seed", "3")
            == 0
        )
    assert run(tiny_target_dir, data, c, "--limit", "2") == 0
    assert a.read_text() == b.read_text()

    def replies(path):
        return [m["value"] for r in lines(path) for m in r["conversations"] if m["from"] == "gpt"]

    assert replies(a) != replies(c)  # sampling at temperature 1 is not greedy


def test_sigterm_ends_a_distillation_as_ctrl_c_does_and_says_what_the_engine_made(
    tiny_target_dir, tmp_path
):
    """A time limit's SIGTERM (dev/gpu/gpu-run.sh stops steps so): exit 130, every reply written
    so far kept whole, and one line with what was made and the engine's time split."""
    import os
    import signal
    import subprocess
    import sys
    import time

    convs = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f"question number {i}"},
                {"from": "gpt", "value": "answer"},
            ],
        }
        for i in range(400)
    ]
    data = f"sharegpt:{write_jsonl(tmp_path / 'src.jsonl', convs)}"
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "redraft.entry", "redraft-distill-data", "--target"]
    cmd += [str(tiny_target_dir), "--data", data, "--output", str(out), "--no-progress"]
    cmd += ["--max-new-tokens", "48", "--batch-size", "2", "--max-turns", "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    t0 = time.monotonic()
    while not (out.is_file() and out.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() - t0 < 120
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err
    assert "interrupted after" in err and "engine: {'steps'" in err and "Traceback" not in err
    assert "written so far are kept" in err
    kept = lines(out)  # every line whole
    assert 2 <= len(kept) < 400
    assert all(r["conversations"][-1]["from"] == "gpt" for r in kept)
