"""Sources → records: every format, the spec grammar, bad records, truncated files, the split."""

import json
import logging
from collections import Counter

import pytest
from data_helpers import CHATS, sharegpt, write_json, write_jsonl, write_parquet

from redraft.data import (
    DataStats,
    default_chat_path,
    default_code_dir,
    is_heldout,
    iter_records,
    parse_spec,
)
from redraft.data.sources import SHAREGPT_FILE, iter_json_list
from redraft.errors import DataError


def _records(spec, **kw):
    stats = DataStats()
    return list(iter_records(spec, stats=stats, **kw)), stats


# ---------------------------------------------------------------------------------------------
# formats


def test_sharegpt_json_list_maps_roles_and_keeps_order(chats_file):
    recs, stats = _records(f"sharegpt:{chats_file}")
    assert [r.id for r in recs] == ["sg-0", "sg-1", "sg-2", "sg-3"]
    assert stats.kept == 4 and not stats.skipped
    assert recs[1].messages[0] == {"role": "system", "content": "You are terse."}
    # user/chatgpt/bard aliases
    assert [m["role"] for m in recs[2].messages] == ["user", "assistant", "user", "assistant"]
    assert recs[2].messages[1]["content"] == "    return a + b\n"
    assert all(
        r.kind == "chat" and r.text is None and r.source == f"sharegpt:{chats_file}" for r in recs
    )


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet"])
def test_sharegpt_other_containers(tmp_path, fmt):
    path = tmp_path / f"chats.{fmt}"
    if fmt == "parquet":
        write_parquet(path, CHATS)
    else:
        write_jsonl(path, CHATS, gz=fmt.endswith("gz"))
    recs, _ = _records(f"sharegpt:{path}")
    assert [r.messages for r in recs] == [r.messages for r in _records_of_fixture()]


def _records_of_fixture():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        return _records(f"sharegpt:{write_json(Path(d) / 'c.json', CHATS)}")[0]


def test_folder_of_files_is_read_in_sorted_order(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", CHATS[2:])
    write_jsonl(tmp_path / "a.jsonl", CHATS[:2])
    (tmp_path / "notes.txt").write_text("ignored")
    recs, _ = _records(f"sharegpt:{tmp_path}")
    assert [r.id for r in recs] == ["sg-0", "sg-1", "sg-2", "sg-3"]


def test_leading_assistant_turn_is_dropped_not_the_record(tmp_path):
    path = write_json(
        tmp_path / "c.json",
        [sharegpt(9, [("gpt", "...continued"), ("human", "ok?"), ("gpt", "yes")])],
    )
    recs, stats = _records(f"sharegpt:{path}")
    assert recs[0].messages == [
        {"role": "user", "content": "ok?"},
        {"role": "assistant", "content": "yes"},
    ]
    assert stats.notes["dropped_leading_assistant"] == 1


def test_ultrachat_both_layouts(tmp_path):
    rows = [
        {"id": "u1", "data": ["Question one?", "Answer one.", "Question two?", "Answer two."]},
        {
            "prompt_id": "p2",
            "prompt": "x",
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
            ],
        },
    ]
    for path in (
        write_jsonl(tmp_path / "u.jsonl", rows),
        write_parquet(tmp_path / "u.parquet", rows[1:]),
    ):
        recs, _ = _records(f"ultrachat:{path}")
        assert recs[-1].id == "p2"
        assert recs[-1].messages == rows[1]["messages"]
    recs, _ = _records(f"ultrachat:{tmp_path / 'u.jsonl'}")
    assert recs[0].id == "u1"
    assert [m["role"] for m in recs[0].messages] == ["user", "assistant", "user", "assistant"]
    assert recs[0].messages[3]["content"] == "Answer two."


def test_stack_lang_and_ext_filters(tmp_path):
    rows = [
        {"hexsha": "a1", "content": "print(1)\n", "lang": "Python", "ext": "py"},
        {"hexsha": "b2", "content": "console.log(1)\n", "lang": "JavaScript", "ext": "js"},
        {"hexsha": "c3", "content": "x = 2\n", "lang": "Python", "ext": "py"},
        {"hexsha": "d4", "content": "   \n", "lang": "Python", "ext": "py"},
    ]
    for path in (
        write_jsonl(tmp_path / "s.jsonl", rows),
        write_parquet(tmp_path / "s.parquet", rows),
    ):
        recs, stats = _records(f"stack:{path}?lang=python")
        assert [(r.id, r.kind, r.text) for r in recs] == [
            ("a1", "doc", "print(1)\n"),
            ("c3", "doc", "x = 2\n"),
        ]
        assert stats.skipped == Counter({"filtered_out": 1, "empty_document": 1})
        recs, _ = _records(f"stack:{path}?ext=js")
        assert [r.id for r in recs] == ["b2"]


def test_code_dir_glob_recursive_and_skips(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("import os\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("def f():\n    return 1\n")
    (tmp_path / "pkg" / "c.txt").write_text("not code")
    (tmp_path / "pkg" / "empty.py").write_text("\n\n")
    (tmp_path / "pkg" / "latin.py").write_bytes(b"x = '\xe9\xff'\n")
    recs, stats = _records(f"code-dir:{tmp_path / 'pkg'}?glob=*.py")
    assert [(r.id, r.text) for r in recs] == [
        ("a.py", "import os\n"),
        ("sub/b.py", "def f():\n    return 1\n"),
    ]
    assert stats.skipped == Counter({"not_utf8": 1, "empty_document": 1})
    recs, _ = _records(f"code-dir:{tmp_path / 'pkg'}?glob=*.txt")
    assert [r.id for r in recs] == ["c.txt"]


def test_bare_path_detects_format_per_record(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [CHATS[0], {"id": "doc", "content": "text"}])
    recs, _ = _records(str(path))
    assert [(r.id, r.kind) for r in recs] == [("sg-0", "chat"), ("doc", "doc")]


def test_records_without_id_get_stable_content_ids(tmp_path):
    rows = [
        {"conversations": CHATS[0]["conversations"]},
        {"conversations": CHATS[3]["conversations"]},
    ]
    path = write_jsonl(tmp_path / "noid.jsonl", rows)
    first, _ = _records(f"sharegpt:{path}")
    again, _ = _records(f"sharegpt:{path}")
    assert [r.id for r in first] == [r.id for r in again]
    assert first[0].id != first[1].id and first[0].id.startswith("sharegpt:")


def test_limit_counts_kept_records(chats_file):
    recs, _ = _records(f"sharegpt:{chats_file}", limit=2)
    assert [r.id for r in recs] == ["sg-0", "sg-1"]


# ---------------------------------------------------------------------------------------------
# bad input


def test_every_bad_record_reason_is_counted(tmp_path):
    bad = [
        5,  # not_an_object
        {"id": "m"},  # missing_field
        {
            "id": "m2",
            "conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}],
        },  # missing_field
        sharegpt("n", [("human", 3), ("gpt", "x")]),  # non_string_turn
        sharegpt("e", [("human", "  \n"), ("gpt", "x")]),  # empty_turn
        sharegpt("u", [("human", "hi"), ("narrator", "x")]),  # unknown_role
        sharegpt("s", [("human", "hi"), ("gpt", "x"), ("system", "late")]),  # misplaced_system
        sharegpt("t", [("human", "hi"), ("human", "again"), ("gpt", "x")]),  # same_role_twice
        sharegpt("a", [("system", "sys"), ("human", "hi")]),  # no_assistant_turn
    ]
    lines = [json.dumps(CHATS[0]), "{not json", *(json.dumps(b) for b in bad), json.dumps(CHATS[1])]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    recs, stats = _records(f"sharegpt:{path}")
    assert [r.id for r in recs] == ["sg-0", "sg-1"]
    assert stats.kept == 2
    assert stats.skipped == Counter(
        {
            "invalid_json": 1,
            "not_an_object": 1,
            "missing_field": 2,
            "non_string_turn": 1,
            "empty_turn": 1,
            "unknown_role": 1,
            "misplaced_system": 1,
            "same_role_twice": 1,
            "no_assistant_turn": 1,
        }
    )
    assert "same_role_twice 1" in stats.summary()


def _list_text(objs):
    parts = [json.dumps(o, ensure_ascii=False, indent=1) for o in objs]
    return "[\n" + ",\n".join(parts) + "\n]\n", parts


def test_truncated_json_list_keeps_complete_records_and_warns_with_offset(tmp_path, caplog):
    objs = [
        sharegpt(i, [("human", f"café ☕ question {i}"), ("gpt", f"answer {i} " * (i + 1))])
        for i in range(5)
    ]
    text, parts = _list_text(objs)
    start_of_4th = len(("[\n" + ",\n".join(parts[:3]) + ",\n").encode("utf-8"))
    data = text.encode("utf-8")[: start_of_4th + 30]  # cut inside the 4th record
    path = tmp_path / "cut.json"
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="redraft.data.sources"):
        recs, _ = _records(f"sharegpt:{path}")
    assert [r.id for r in recs] == ["sg-0", "sg-1", "sg-2"]
    warnings = [
        r.getMessage() for r in caplog.records if "stops being valid JSON" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert (
        f"byte offset {start_of_4th}" in warnings[0]
        and "kept the 3 complete records" in warnings[0]
    )


@pytest.mark.parametrize("chunk_chars", [7, 64, 1 << 20])
def test_json_list_stream_parser_matches_json_loads_for_any_buffer_size(tmp_path, chunk_chars):
    objs = [
        sharegpt(i, [("human", "ü" * i + '"quoted" \\ back'), ("gpt", "x" * (10 * i))])
        for i in range(12)
    ]
    path = tmp_path / "full.json"
    path.write_text(_list_text(objs)[0], encoding="utf-8")
    assert list(iter_json_list(path, chunk_chars=chunk_chars)) == json.loads(path.read_text())


def test_file_that_is_not_json_names_file_and_offset(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text("hello, this is prose\n")
    with pytest.raises(DataError, match=r"notes\.json.*byte offset 0"):
        _records(f"sharegpt:{path}")
    path = tmp_path / "broken.jsonl"
    path.write_text("{oops\n" + json.dumps(CHATS[0]) + "\n")
    with pytest.raises(DataError, match=r"broken\.jsonl.*line 1 \(byte offset 0\)"):
        _records(f"sharegpt:{path}")
    path = tmp_path / "badlist.json"
    path.write_text('[{"id": 1,, }]')
    with pytest.raises(DataError, match=r"badlist\.json.*byte offset 1"):
        _records(f"sharegpt:{path}")


def test_unknown_spec_and_missing_path_are_actionable():
    with pytest.raises(DataError, match="Unknown data source 'wiki:foo'.*sharegpt:PATH_OR_ID"):
        parse_spec("wiki:foo")
    with pytest.raises(DataError, match="Unknown option"):
        parse_spec("stack:/x?language=python")
    with pytest.raises(DataError, match="does not exist"):
        list(iter_records("sharegpt:/nonexistent/dir/file.json"))


def test_unreachable_hub_dataset_is_a_data_error():
    with pytest.raises(DataError, match="ultrachat:nobody-xyz/no-such-dataset"):
        list(iter_records("ultrachat:nobody-xyz/no-such-dataset", limit=1))


# ---------------------------------------------------------------------------------------------
# mixtures


def test_mixture_interleaves_by_weight_and_stops_at_first_exhausted(tmp_path):
    a = write_jsonl(
        tmp_path / "a.jsonl", [sharegpt(f"a{i}", [("human", "q"), ("gpt", "a")]) for i in range(10)]
    )
    b = write_jsonl(
        tmp_path / "b.jsonl", [sharegpt(f"b{i}", [("human", "q"), ("gpt", "b")]) for i in range(10)]
    )
    recs, _ = _records(f"2*sharegpt:{a},1*sharegpt:{b}")
    src = [r.id[3] for r in recs]
    assert src.count("a") == 10 and src.count("b") == 5
    for k in range(1, 6):  # every prefix of 3k records holds exactly 2k from a
        assert src[: 3 * k].count("a") == 2 * k
    assert [r.id for r in recs if r.id[3] == "b"] == [
        f"sg-b{i}" for i in range(5)
    ]  # file order kept


def test_unweighted_mixture_reads_every_record_of_every_component(tmp_path):
    a = write_jsonl(
        tmp_path / "a.jsonl", [sharegpt(f"a{i}", [("human", "q"), ("gpt", "a")]) for i in range(5)]
    )
    b = write_jsonl(
        tmp_path / "b.jsonl", [sharegpt(f"b{i}", [("human", "q"), ("gpt", "b")]) for i in range(2)]
    )
    recs, _ = _records(f"sharegpt:{a},sharegpt:{b}")
    assert [r.id for r in recs] == ["sg-a0", "sg-b0", "sg-a1", "sg-b1", "sg-a2", "sg-a3", "sg-a4"]


def test_spec_grammar_weights():
    comps = parse_spec("default-chat:0.7,default-code:0.3")
    assert [(c.kind, c.weight, c.arg) for c in comps] == [
        ("default-chat", 0.7, None),
        ("default-code", 0.3, None),
    ]
    comps = parse_spec("0.25*stack:bigcode/the-stack-dedup?lang=python&split=train")
    assert (comps[0].kind, comps[0].arg, comps[0].weight) == (
        "stack",
        "bigcode/the-stack-dedup",
        0.25,
    )
    assert comps[0].options == {"lang": "python", "split": "train"}


# ---------------------------------------------------------------------------------------------
# split


def test_heldout_split_is_deterministic_nested_and_near_the_fraction():
    ids = [f"rec-{i}" for i in range(20000)]
    small = {i for i in ids if is_heldout(i, 0.02)}
    large = {i for i in ids if is_heldout(i, 0.10)}
    assert small == {i for i in ids if is_heldout(i, 0.02)}
    assert small <= large
    assert 0.015 < len(small) / len(ids) < 0.025
    assert 0.09 < len(large) / len(ids) < 0.11
    assert not any(is_heldout(i, 0.0) for i in ids[:100]) and all(
        is_heldout(i, 1.0) for i in ids[:100]
    )


# ---------------------------------------------------------------------------------------------
# the embedded defaults


def test_default_paths():
    assert default_chat_path().name == SHAREGPT_FILE and default_chat_path().is_file()
    assert (default_code_dir() / "os.py").is_file()


def test_default_sharegpt_recovers_every_complete_record(caplog):
    with caplog.at_level(logging.WARNING, logger="redraft.data.sources"):
        stats = DataStats()
        n = sum(1 for _ in iter_records("default-chat", stats=stats))
    assert stats.kept + stats.total_skipped == 17671
    assert n == stats.kept > 17000
    assert sum("kept the 17671 complete records" in r.getMessage() for r in caplog.records) <= 1


def test_default_code_is_the_stdlib_without_site_packages():
    recs = list(iter_records("default-code", limit=3000))
    ids = {r.id for r in recs}
    assert "os.py" in ids and "json/decoder.py" in ids
    assert not any(i.startswith(("site-packages/", "__pycache__")) for i in ids)


def test_repo_manifest_specs_parse_and_sample_fixture_reads():
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2] / "data"
    manifest = yaml.safe_load((root / "sources.yaml").read_text())
    for group in manifest.values():
        for spec in group.values():
            assert parse_spec(spec)
    recs, stats = _records(f"sharegpt:{root / 'fixtures' / 'sample-sharegpt.jsonl'}")
    assert [r.id for r in recs] == [f"sample-{i}" for i in range(5)] and not stats.skipped
