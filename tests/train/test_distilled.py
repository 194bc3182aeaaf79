"""self_distill: the run trains on the target's own replies, made once and reused."""

import json

from redraft.data.records import is_heldout
from redraft.train.config import make_config
from redraft.train.distilled import DONE_SUFFIX, distill_dir
from redraft.train.fingerprint import target_record
from redraft.train.trainer import train


def _cfg(tmp_path, chat_file, **over):
    base = {
        "output_dir": str(tmp_path / "run"),
        "report_to": "none",
        "data": f"sharegpt:{chat_file}",
        "self_distill": "true",
        "distill_dir": str(tmp_path / "distilled"),
        "distill_limit": "12",
        "distill_max_new_tokens": "6",
        "eval_limit": "4",
        "max_steps": "2",
    }
    base.update(over)
    return make_config("tiny", base)


def test_a_self_distilled_run_trains_on_the_targets_replies_and_reuses_them(
    tmp_path, tiny_target, chat_file, capsys
):
    cfg = _cfg(tmp_path, chat_file)
    metrics = train(cfg, target=tiny_target)
    out = tmp_path / "distilled"
    train_rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    held_rows = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert 0 < len(train_rows) <= 12 and 0 < len(held_rows) <= 4
    assert not any(is_heldout(r["id"], cfg.heldout_fraction) for r in train_rows)
    assert all(is_heldout(r["id"], cfg.heldout_fraction) for r in held_rows)
    # the replies are the target's (the tiny random target never counts words as the data does)
    source = {
        json.loads(line)["id"]: json.loads(line) for line in chat_file.read_text().splitlines()
    }
    r = train_rows[0]
    assert r["distilled_with"]["max_new_tokens"] == 6
    assert r["conversations"][1]["value"] != source[r["id"]]["conversations"][1]["value"]
    assert (out / ("train.jsonl" + DONE_SUFFIX)).is_file() and metrics["eval_positions"] > 0
    # a second run reads the finished files and generates nothing
    capsys.readouterr()
    before = (out / "train.jsonl").stat().st_mtime_ns
    train(_cfg(tmp_path, chat_file, output_dir=str(tmp_path / "run2")), target=tiny_target)
    said = capsys.readouterr()
    assert "self-distilled train data found" in said.out + said.err
    assert (out / "train.jsonl").stat().st_mtime_ns == before


def test_the_default_cache_folder_is_keyed_by_target_and_settings(tmp_path, tiny_target, chat_file):
    rec = target_record(tiny_target)
    a = distill_dir(_cfg(tmp_path, chat_file, distill_dir=""), rec)
    b = distill_dir(_cfg(tmp_path, chat_file, distill_dir="", distill_max_new_tokens="7"), rec)
    c = distill_dir(_cfg(tmp_path, chat_file, distill_dir="", lr="0.5"), rec)
    assert a != b and a == c and a.parent.name == "distilled"


def test_a_file_made_for_more_conversations_gives_a_smaller_limit_its_first_ones(
    tmp_path, tiny_target, chat_file
):
    """A cache extended by an earlier, larger run: a run asking for fewer reads the replies to
    its own first N source conversations (the records a fresh run with N makes), not the lot."""
    from types import SimpleNamespace

    from redraft.train.distilled import distilled_data

    said = []
    env = SimpleNamespace(is_main=True, say=said.append, barrier=lambda: None)
    rec = target_record(tiny_target)
    cfg = _cfg(tmp_path, chat_file, distill_limit="12")
    big = distilled_data(cfg, tiny_target, rec, env)
    out = tmp_path / "distilled"
    assert big.data == f"sharegpt:{out / 'train.jsonl'}"
    small = distilled_data(_cfg(tmp_path, chat_file, distill_limit="5"), tiny_target, rec, env)
    view = out / "train.first-5.jsonl"
    assert small.data == f"sharegpt:{view}"
    assert any("made for 12 conversations; the first 5: train.first-5.jsonl" in m for m in said)
    # the eval file was made for the same eval_limit: read whole
    assert small.eval_data == f"sharegpt:{out / 'heldout.jsonl'}"
    ids = [json.loads(line)["id"] for line in view.read_text().splitlines()]
    train_ids = [
        json.loads(line)["id"]
        for line in chat_file.read_text().splitlines()
        if not is_heldout(json.loads(line)["id"], cfg.heldout_fraction)
    ]
    assert sorted(ids) == sorted(train_ids[:5]) and len(train_ids) > 5
    # what a fresh cache with limit 5 holds: the same conversations, the same replies
    fresh = distilled_data(
        _cfg(tmp_path, chat_file, distill_limit="5", distill_dir=str(tmp_path / "fresh")),
        tiny_target,
        rec,
        env,
    )
    fresh_file = tmp_path / "fresh" / "train.jsonl"
    assert fresh.data == f"sharegpt:{fresh_file}"
    by_id = {
        json.loads(x)["id"]: json.loads(x)["conversations"]
        for x in fresh_file.read_text().splitlines()
    }
    assert {
        json.loads(x)["id"]: json.loads(x)["conversations"] for x in view.read_text().splitlines()
    } == by_id
    # asking for as many as were made reads the file itself
    again = distilled_data(_cfg(tmp_path, chat_file, distill_limit="12"), tiny_target, rec, env)
    assert again.data == big.data
