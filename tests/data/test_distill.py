"""redraft-distill-data: the target's own replies, batched, resumable without duplicates."""

import json

import pytest
from data_helpers import CHATS, write_jsonl

from redraft.data import iter_records
from redraft.data.distill import _prompt_ids, generate_replies, main


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def run(tiny_target_dir, data, out, *extra):
    return main(["--target", str(tiny_target_dir), "--data", data, "--output", str(out), "--max-new-tokens", "5",
                 "--batch-size", "3", "--no-progress", *extra])


def test_batched_left_padded_generation_equals_one_by_one(tiny_target):
    tok = tiny_target.tokenizer
    prompts = [_prompt_ids(tok, [{"role": "user", "content": text}])
               for text in ("Hi", "Speculative decoding drafts tokens and the target verifies them", "print(x)")]
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
        assert not replies & {m["content"] for m in src[rec.id].messages if m["role"] == "assistant"}
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
    assert run(tiny_target_dir, data, b, "--limit", "3", "--batch-size", "1", "--sort-window", "1") == 0
    by_id = lambda path: {r["id"]: r for r in lines(path)}  # noqa: E731
    assert by_id(a) == by_id(b) and len(by_id(a)) == 3  # batching and sorting do not change greedy replies
    assert [r["id"] for r in lines(b)] == ["sg-0", "sg-1", "sg-2"]  # --sort-window 1 keeps the source order


def test_bad_data_spec_exits_with_a_message(tiny_target_dir, tmp_path, capsys):
    assert run(tiny_target_dir, "nonsense:spec", tmp_path / "o.jsonl") == 1
    assert "Unknown data source" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--help"])
def test_cli_help(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main([flag])
    assert exc.value.code == 0
    assert "--max-new-tokens" in capsys.readouterr().out


def test_sampled_distillation_is_seeded(tiny_target_dir, tmp_path):
    data = f"sharegpt:{write_jsonl(tmp_path / 'src.jsonl', CHATS)}"
    a, b, c = (tmp_path / f"{x}.jsonl" for x in "abc")
    for path in (a, b):
        assert run(tiny_target_dir, data, path, "--limit", "2", "--temperature", "1.0", "--seed", "3") == 0
    assert run(tiny_target_dir, data, c, "--limit", "2") == 0
    assert a.read_text() == b.read_text()
    replies = lambda path: [m["value"] for r in lines(path) for m in r["conversations"] if m["from"] == "gpt"]  # noqa: E731
    assert replies(a) != replies(c)  # sampling at temperature 1 is not greedy
