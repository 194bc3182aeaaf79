"""Records → token ids + assistant-only loss masks; caching, packing, the split, token arrays."""

import copy

import numpy as np
import pytest
from data_helpers import CHATS, sharegpt, write_json, write_jsonl

from redraft.data import build_token_dataset, is_heldout, iter_records, iter_token_arrays
from redraft.data.records import DataStats
from redraft.data.tokens import ChatRenderer, cache_meta


def chat_ids(tok, messages, add_generation_prompt=False):
    out = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def reference_mask(tok, messages):
    """Token-level growing-prefix mask through the public apply_chat_template (an independent
    derivation): tokens between the generation prompt of turn k and the rendering through turn k,
    minus what follows that turn's eos token."""
    full = chat_ids(tok, messages)
    mask = np.zeros(len(full), dtype=np.int8)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = chat_ids(tok, messages[:k], add_generation_prompt=True) if k else []
        through = chat_ids(tok, messages[: k + 1])
        assert full[: len(through)] == through
        # a token that straddles the header and the reply (e.g. "\n" + leading spaces) counts as reply
        start = next((i for i, (a, b) in enumerate(zip(before, through)) if a != b), len(before))
        span = list(range(start, len(through)))
        eos = [i for i in span if full[i] == tok.eos_token_id]
        mask[span[0] : (eos[-1] if eos else span[-1]) + 1] = 1
    return full, mask


def runs(ids, mask):
    """The masked stretches of ids, as lists."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [list(np.asarray(ids)[s:e]) for s, e in zip(edges[::2], edges[1::2])]


def records(path):
    return list(iter_records(f"sharegpt:{path}", stats=DataStats()))


@pytest.mark.parametrize("template", ["chatml", "llama2"])
def test_mask_covers_exactly_each_reply_and_its_end_of_turn_token(
    template, chats_file, chatml_tokenizer, llama2_tokenizer, tmp_path
):
    tok = chatml_tokenizer if template == "chatml" else llama2_tokenizer
    ds = build_token_dataset(
        f"sharegpt:{chats_file}", tok, split="all", cache_dir=tmp_path, num_proc=1, progress=False
    )
    recs = {r.id: r for r in records(chats_file)}
    assert ds["id"] == list(recs)
    for row in ds:
        messages = recs[row["id"]].messages
        full, ref = reference_mask(tok, messages)
        assert row["input_ids"] == full
        assert row["loss_mask"] == ref.tolist()  # token by token
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        # and what the mask selects reads back as each reply plus its end-of-turn marker, nothing else
        decoded = [tok.decode(r) for r in runs(row["input_ids"], np.array(row["loss_mask"]))]
        head, tail = ("", "<|im_end|>") if template == "chatml" else (" ", " </s>")
        for d, r in zip(decoded, replies, strict=True):
            straddles = (
                r[0].isspace() and d == "\n" + head + r + tail
            )  # the header's "\n" merged into the reply
            assert d == head + r + tail or straddles


def test_renderer_matches_apply_chat_template(chats_file, chatml_tokenizer, llama2_tokenizer):
    for tok in (chatml_tokenizer, llama2_tokenizer):
        renderer = ChatRenderer(tok)
        for r in records(chats_file):
            for gen in (False, True):
                assert renderer.render(r.messages, gen) == tok.apply_chat_template(
                    r.messages, tokenize=False, add_generation_prompt=gen
                )


def test_truncation_drops_rows_without_assistant_tokens(chats_file, chatml_tokenizer, tmp_path):
    refs = [(r.id, *reference_mask(chatml_tokenizer, r.messages)) for r in records(chats_file)]
    L = (
        min(int(np.argmax(ref)) for _, _, ref in refs) + 2
    )  # the earliest reply is cut after 2 tokens
    ds = build_token_dataset(
        f"sharegpt:{chats_file}",
        chatml_tokenizer,
        split="all",
        max_length=L,
        cache_dir=tmp_path,
        num_proc=1,
        progress=False,
    )
    expected = [(rid, full[:L], ref[:L].tolist()) for rid, full, ref in refs if ref[:L].any()]
    assert 1 <= len(expected) < 4  # the fixture has records whose first reply starts later
    assert [(x["id"], x["input_ids"], x["loss_mask"]) for x in ds] == expected
    meta = cache_meta(next(tmp_path.glob("tokens-*")))
    assert meta["tokenize_skipped"] == {"no_loss_tokens": 4 - len(expected)}


def test_documents_count_every_token_and_split_into_windows(tmp_path, chatml_tokenizer):
    (tmp_path / "src").mkdir()
    texts = {
        "a.py": "def add(a, b):\n    return a + b\n" * 5,
        "b.py": "import torch\nx = torch.zeros(3)\n",
    }
    for name, text in texts.items():
        (tmp_path / "src" / name).write_text(text)
    ds = build_token_dataset(
        f"code-dir:{tmp_path / 'src'}",
        chatml_tokenizer,
        split="all",
        max_length=16,
        cache_dir=tmp_path / "cache",
        num_proc=1,
        progress=False,
    )
    for name, text in texts.items():
        rows = [x for x in ds if x["id"] == name or x["id"].startswith(name + "#")]
        ids = chatml_tokenizer(text)["input_ids"]
        assert [t for x in rows for t in x["input_ids"]] == ids
        assert all(len(x["input_ids"]) <= 16 and set(x["loss_mask"]) == {1} for x in rows)
        assert len(rows) == -(-len(ids) // 16)


def test_packing_concatenates_rows_into_fixed_lengths(chats_file, chatml_tokenizer, tmp_path):
    spec = f"sharegpt:{chats_file}"
    flat = build_token_dataset(
        spec,
        chatml_tokenizer,
        split="all",
        max_length=100_000,
        cache_dir=tmp_path,
        num_proc=1,
        progress=False,
    )
    packed = build_token_dataset(
        spec,
        chatml_tokenizer,
        split="all",
        max_length=16,
        pack=True,
        cache_dir=tmp_path,
        num_proc=1,
        progress=False,
    )
    lengths = [len(x) for x in packed["input_ids"]]
    assert all(n == 16 for n in lengths[:-1]) and 2 <= lengths[-1] <= 16
    assert sum(packed["input_ids"], []) == sum(flat["input_ids"], [])
    assert sum(packed["loss_mask"], []) == sum(flat["loss_mask"], [])


def test_split_is_disjoint_and_covers_everything(tmp_path, chatml_tokenizer):
    chats = [sharegpt(i, [("human", f"question {i}"), ("gpt", f"answer {i}")]) for i in range(60)]
    spec = f"sharegpt:{write_jsonl(tmp_path / 'many.jsonl', chats)}"
    kw = dict(heldout_fraction=0.3, cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    train = set(build_token_dataset(spec, chatml_tokenizer, split="train", **kw)["id"])
    held = set(build_token_dataset(spec, chatml_tokenizer, split="heldout", **kw)["id"])
    assert train.isdisjoint(held) and train | held == {f"sg-{i}" for i in range(60)}
    assert held == {f"sg-{i}" for i in range(60) if is_heldout(f"sg-{i}", 0.3)}
    assert 5 < len(held) < 30


def test_parallel_workers_give_identical_rows(tmp_path, chatml_tokenizer):
    chats = [
        sharegpt(
            i,
            [
                ("human", f"q {i} " * (i % 7 + 1)),
                ("gpt", f"a {i} " * (i % 5 + 1)),
                ("human", "more"),
                ("gpt", "done"),
            ],
        )
        for i in range(700)
    ]
    spec = f"sharegpt:{write_jsonl(tmp_path / 'many.jsonl', chats)}"
    one = build_token_dataset(
        spec, chatml_tokenizer, split="all", cache_dir=tmp_path / "c1", num_proc=1, progress=False
    )
    two = build_token_dataset(
        spec, chatml_tokenizer, split="all", cache_dir=tmp_path / "c2", num_proc=2, progress=False
    )
    assert one["id"] == two["id"] and len(one) == 700  # 3 chunks of 256 records, in order
    assert one["input_ids"] == two["input_ids"] and one["loss_mask"] == two["loss_mask"]


def test_cache_is_reused_and_keyed_by_settings_source_and_tokenizer(
    tmp_path, chatml_tokenizer, monkeypatch
):
    path = write_json(tmp_path / "c.json", CHATS)
    spec, kw = (
        f"sharegpt:{path}",
        dict(split="all", cache_dir=tmp_path / "cache", num_proc=1, progress=False),
    )
    first = build_token_dataset(spec, chatml_tokenizer, **kw)

    def boom(self, records):
        raise AssertionError("re-tokenized although the cache holds this entry")

    monkeypatch.setattr("redraft.data.encode.Encoder.__call__", boom)
    again = build_token_dataset(spec, chatml_tokenizer, **kw)
    assert again["input_ids"] == first["input_ids"]
    for changed in (dict(kw, max_length=8), dict(kw, split="train")):
        with pytest.raises(AssertionError, match="re-tokenized"):
            build_token_dataset(spec, chatml_tokenizer, **changed)
    other_template = copy.deepcopy(chatml_tokenizer)
    other_template.chat_template = chatml_tokenizer.chat_template.replace("assistant", "bot")
    assert other_template.chat_template != chatml_tokenizer.chat_template
    with pytest.raises(AssertionError, match="re-tokenized"):
        build_token_dataset(spec, other_template, **kw)
    write_json(path, CHATS[:2])  # the source changed on disk
    with pytest.raises(AssertionError, match="re-tokenized"):
        build_token_dataset(spec, chatml_tokenizer, **kw)


def test_template_failures_are_counted_not_raised(tmp_path, chatml_tokenizer):
    path = write_json(tmp_path / "c.json", CHATS)
    no_system = copy.deepcopy(chatml_tokenizer)
    no_system.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}" + chatml_tokenizer.chat_template
    )
    ds = build_token_dataset(
        f"sharegpt:{path}", no_system, split="all", cache_dir=tmp_path, num_proc=1, progress=False
    )
    assert ds["id"] == ["sg-0", "sg-2", "sg-3"]  # sg-1 has a system turn
    assert cache_meta(next(tmp_path.glob("tokens-*")))["tokenize_skipped"] == {"template_error": 1}
    # a template that renders the last turn differently: earlier replies have no stable span
    last_differs = copy.deepcopy(chatml_tokenizer)
    last_differs.chat_template = (
        "{% for m in messages %}{% if loop.last %}<|im_start|>{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    ds = build_token_dataset(
        f"sharegpt:{path}",
        last_differs,
        split="all",
        cache_dir=tmp_path / "b",
        num_proc=1,
        progress=False,
    )
    meta = cache_meta(next((tmp_path / "b").glob("tokens-*")))
    assert meta["tokenize_skipped"] == {"template_not_prefix": 2}  # sg-1 and sg-2 have two replies


def test_token_arrays_are_full_renderings(tmp_path, chats_file, chatml_tokenizer):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text("for i in range(10):\n    print(i * i)\n" * 50)
    spec = f"sharegpt:{chats_file},code-dir:{tmp_path / 'src'}"
    arrays = list(
        iter_token_arrays(
            spec, chatml_tokenizer, cache_dir=tmp_path / "cache", num_proc=1, progress=False
        )
    )
    recs = list(iter_records(spec))
    # unweighted: one record of each in turn, then the rest of the chats when code-dir (1 file) runs out
    assert [r.kind for r in recs] == ["chat", "doc", "chat", "chat", "chat"] and len(arrays) == 5
    assert all(a.dtype == np.int32 for a in arrays)
    for i in (0, 2, 3, 4):
        assert arrays[i].tolist() == chat_ids(chatml_tokenizer, recs[i].messages)
    assert (
        arrays[1].tolist() == chatml_tokenizer(recs[1].text)["input_ids"]
    )  # not cut at any max_length
    assert len(arrays[1]) > 300


# ---------------------------------------------------------------------------------------------
# the real default target (SmolLM2-135M-Instruct, ChatML with a default system prompt)


@pytest.mark.slow
def test_default_target_masks_on_default_sharegpt(default_target, tmp_path):
    tok = default_target.tokenizer
    ds = build_token_dataset(
        "default-chat",
        tok,
        split="all",
        max_length=4096,
        limit=60,
        cache_dir=tmp_path,
        num_proc=1,
        progress=False,
    )
    recs = {r.id: r for r in iter_records("default-chat", limit=80)}
    checked = 0
    for row in ds.select(range(25)):
        full, ref = reference_mask(tok, recs[row["id"]].messages)
        if len(full) > 4096:
            continue
        assert row["input_ids"] == full and row["loss_mask"] == ref.tolist()
        replies = [m["content"] for m in recs[row["id"]].messages if m["role"] == "assistant"]
        assert [tok.decode(r) for r in runs(full, ref)] == [r + "<|im_end|>" for r in replies]
        checked += 1
    assert checked >= 15


def test_an_empty_split_is_an_empty_dataset_not_an_error(tmp_path, chats_file, chatml_tokenizer):
    ds = build_token_dataset(
        f"sharegpt:{chats_file}",
        chatml_tokenizer,
        split="heldout",
        heldout_fraction=0.0,
        cache_dir=tmp_path,
        num_proc=1,
        progress=False,
    )
    assert len(ds) == 0 and ds.column_names == ["id", "input_ids", "loss_mask"]


def test_a_crashed_build_leaves_nothing_that_is_reused(tmp_path, chats_file, chatml_tokenizer):
    spec = f"sharegpt:{chats_file}"
    ds = build_token_dataset(
        spec,
        chatml_tokenizer,
        split="all",
        cache_dir=tmp_path / "cache",
        num_proc=1,
        progress=False,
    )
    (entry,) = (tmp_path / "cache").glob("tokens-*")
    stale = entry.with_name(entry.name + ".tmp999999999")  # a pid that cannot exist
    stale.mkdir()
    (stale / "data.arrow").write_bytes(b"half")
    import shutil

    shutil.rmtree(entry)
    again = build_token_dataset(
        spec,
        chatml_tokenizer,
        split="all",
        cache_dir=tmp_path / "cache",
        num_proc=1,
        progress=False,
    )
    assert again["input_ids"] == ds["input_ids"]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [entry.name]


def test_worker_pools_end_under_a_cli_sigterm_handler():
    """A CLI that turns SIGTERM into SystemExit (to clean up) must not hang the tokenizer pool:
    forked workers inheriting that handler survived Pool.terminate() and the parent waited."""
    import subprocess
    import sys

    code = (
        "import signal, sys\n"
        "from redraft.data import encode\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
        "class Enc:\n"
        "    def __call__(self, records):\n"
        "        return len(records)\n"
        "for _ in range(30):\n"
        "    assert list(encode.map_chunks(Enc(), iter([[1], [2, 3], [4]]), 2)) == [1, 2, 1]\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
