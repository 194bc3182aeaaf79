"""The artifact round-trip and the decoder's lookups; bad artifacts give clear errors."""

import json

import numpy as np
import pytest
import torch

from redraft.errors import ArtifactError, ConfigError, FingerprintMismatchError
from redraft.ngrams import (
    NGramTables,
    TrigramTable,
    build_extended,
    build_trigram_table,
    count_trigrams,
    save_tables,
)

V = 50


@pytest.fixture(scope="module")
def parts():
    g = torch.Generator().manual_seed(0)
    bigram_ids = torch.randint(0, V, (V, 5), generator=g, dtype=torch.int32)
    bigram_probs = torch.rand(V, 5, generator=g).sort(-1, descending=True).values
    rng = np.random.default_rng(0)
    records = [rng.integers(0, 6, size=40) for _ in range(30)]  # few ids: contexts repeat
    return {
        "unigram": (torch.tensor([3, 1, 4], dtype=torch.int32), torch.tensor([0.5, 0.25, 0.125])),
        "bigram": (bigram_ids, bigram_probs),
        "extended": build_extended(bigram_ids, w=3),
        "trigram": build_trigram_table(count_trigrams(records, V), t=4, min_count=1),
    }


def _save(path, parts, fingerprint="sha256:abc", **meta):
    return save_tables(
        path,
        dict(vocab_size=V, tokenizer_fingerprint=fingerprint, trigram={"t": 4}, **meta),
        **parts,
    )


def test_round_trip_and_lookups(parts, tmp_path):
    tables = NGramTables.load(_save(tmp_path / "t", parts))
    assert tables.kinds == ["unigram", "bigram", "extended", "trigram"]
    assert (tables.vocab_size, tables.k, tables.w, tables.t) == (V, 5, 3, 4)
    assert tables.fingerprint == "sha256:abc" and tables.meta["format"] == "redraft-ngrams"

    ids, probs = tables.unigram_topk(2)
    assert ids.tolist() == [3, 1] and ids.dtype == torch.long
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.25]))

    x = torch.tensor([7, 0, 7, 49])
    ids, probs = tables.bigram_topk(x, k=3)
    assert torch.equal(ids, parts["bigram"][0][x, :3].long())
    torch.testing.assert_close(probs, parts["bigram"][1][x, :3].half().float())  # stored as f16

    ext = tables.extended(x)
    assert ext.shape == (4, 5, 3) and ext.dtype == torch.long
    assert torch.equal(ext[:, :, 0], tables.bigram_topk(x)[0])  # column 0: the successor itself
    assert torch.equal(ext, parts["extended"][x].long())
    assert tables.extended(x, k=2, w=2).shape == (4, 2, 2)


@pytest.mark.parametrize("dense", [True, False], ids=["padded-rows", "csr-gather"])
def test_trigram_successors_fill_missing_with_minus_one(parts, tmp_path, dense, monkeypatch):
    if not dense:
        monkeypatch.setattr(TrigramTable, "DENSE_MAX_BYTES", 0)
    tables = NGramTables.load(_save(tmp_path / "t", parts))
    table = parts["trigram"]
    key = int(table.context_keys[0])
    lo, hi = table.offsets[0], table.offsets[1]
    w1 = torch.tensor([key // V, 40, key // V])
    w2 = torch.tensor([key % V, 41, key % V])  # middle context never occurs (ids >= 6 unseen)
    ids, probs = tables.trigram_successors(w1, w2)
    assert ids.shape == (3, 4) and ids.dtype == torch.long and probs.dtype == torch.float32
    n = hi - lo
    assert ids[0, :n].tolist() == table.ids[lo:hi].tolist()
    np.testing.assert_allclose(probs[0, :n].numpy(), table.probs[lo:hi], rtol=1e-3)
    assert ids[0, n:].tolist() == [-1] * (4 - n) and probs[0, n:].sum() == 0
    assert ids[1].tolist() == [-1] * 4 and probs[1].sum() == 0
    assert torch.equal(ids[2], ids[0])
    assert tables.trigram_successors(w1, w2, t=2)[0].shape == (3, 2)


def test_every_stored_context_is_found(parts, tmp_path):
    tables = NGramTables.load(_save(tmp_path / "t", parts))
    table = parts["trigram"]
    loaded = tables.trigram
    assert isinstance(loaded, TrigramTable) and (loaded.t, loaded.min_count) == (4, 1)
    np.testing.assert_array_equal(loaded.offsets, table.offsets)
    np.testing.assert_array_equal(loaded.ids, table.ids)
    np.testing.assert_array_equal(loaded.context_counts, table.context_counts)
    np.testing.assert_array_equal(loaded.probs, table.probs.astype(np.float16))  # f16 on disk
    keys = torch.from_numpy(np.array(table.context_keys))
    ids, _ = tables.trigram_successors(keys // V, keys % V)
    lengths = (ids >= 0).sum(-1).numpy()
    np.testing.assert_array_equal(lengths, np.diff(table.offsets))


def test_fingerprint_mismatch_names_both(parts, tmp_path, tiny_target):
    path = _save(
        tmp_path / "t", {"unigram": parts["unigram"]}, fingerprint="sha256:0000000000000000"
    )
    with pytest.raises(FingerprintMismatchError) as err:
        NGramTables.load(path, target=tiny_target)
    assert "sha256:0000000000000000" in str(err.value) and tiny_target.fingerprint in str(err.value)


def test_adding_a_kind_keeps_the_others_and_rejects_another_tokenizer(parts, tmp_path):
    path = _save(tmp_path / "t", {"unigram": parts["unigram"]})
    _save(path, {"bigram": parts["bigram"]})
    assert NGramTables.load(path).kinds == ["unigram", "bigram"]
    with pytest.raises(ArtifactError, match="tokenizer_fingerprint"):
        _save(path, {"bigram": parts["bigram"]}, fingerprint="sha256:other")


def test_truncated_corrupted_missing_and_unknown(parts, tmp_path):
    path = _save(tmp_path / "t", parts)
    f = path / "bigram.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-10])
    with pytest.raises(ArtifactError, match="truncated"):
        NGramTables.load(path)
    with pytest.raises(ArtifactError, match="cannot be read as safetensors"):
        NGramTables.load(path, verify=False)
    f.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(ArtifactError, match="corrupted"):
        NGramTables.load(path)
    f.write_bytes(data)
    assert NGramTables.load(path, kinds=["bigram"]).kinds == ["bigram"]
    with pytest.raises(ConfigError, match="unknown n-gram kind 'fourgram'"):
        NGramTables.load(path, kinds=["fourgram"])
    (path / "ngrams.json").write_text(json.dumps({"format": "redraft-ngrams"})[:-3])
    with pytest.raises(ArtifactError, match="not valid JSON"):
        NGramTables.load(path)
    with pytest.raises(ArtifactError):
        NGramTables.load(tmp_path / "does-not-exist")


def test_missing_kind_and_too_many_columns(parts, tmp_path):
    tables = NGramTables.load(_save(tmp_path / "t", {"bigram": parts["bigram"]}))
    with pytest.raises(ArtifactError, match="no trigram table"):
        tables.trigram_successors(torch.tensor([1]), torch.tensor([2]))
    with pytest.raises(ConfigError, match="k=9"):
        tables.bigram_topk(torch.tensor([1]), k=9)


def _rewrite_meta(path, change):
    meta = json.loads((path / "ngrams.json").read_text())
    change(meta)
    (path / "ngrams.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda m: m.pop("files"), "lacks the key 'files'"),
        (lambda m: m.pop("vocab_size"), "lacks the key 'vocab_size'"),
        (lambda m: m.update(vocab_size="50"), "vocab_size '50'"),
        (lambda m: m.update(files={}), "has files {}"),
        (
            lambda m: m["files"].update(fourgram={"file": "x"}),
            r"unknown table kind\(s\) \['fourgram'\]",
        ),
        (lambda m: m["files"]["bigram"].pop("sha256"), "lacks files.bigram.sha256"),
        (lambda m: m["files"]["bigram"].update(file="../bigram.safetensors"), "plain file name"),
        (lambda m: m.update(kinds=["bigram"]), "says kinds"),
        (lambda m: m.update(format="other"), "format 'other'"),
    ],
)
def test_a_damaged_ngrams_json_names_what_is_wrong(parts, tmp_path, change, message):
    path = _save(tmp_path / "t", {"unigram": parts["unigram"], "bigram": parts["bigram"]})
    _rewrite_meta(path, change)
    with pytest.raises(ArtifactError, match=message) as err:
        NGramTables.load(path)
    assert str(path / "ngrams.json") in str(err.value)


def test_without_files_the_cut_trigram_file_is_never_loaded_as_empty(parts, tmp_path):
    path = _save(tmp_path / "t", {"trigram": parts["trigram"]})
    f = path / "trigram.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _rewrite_meta(path, lambda m: m.pop("files"))
    with pytest.raises(ArtifactError, match="'files'"):
        NGramTables.load(path)
    # verify=False still needs the file list, not the checksums
    _rewrite_meta(path, lambda m: m.update(files={"trigram": {"file": "trigram.safetensors"}}))
    with pytest.raises(ArtifactError, match="cannot be read as safetensors"):
        NGramTables.load(path, verify=False)
