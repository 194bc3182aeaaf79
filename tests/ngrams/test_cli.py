"""redraft-build-ngrams end to end on the tiny target and a tiny code corpus."""

import json

import pytest
import torch

from redraft.ngrams import NGramTables
from redraft.ngrams.cli import main

CODE = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
    "import torch\nx = torch.zeros(3)\nprint(x)\nfor i in range(10):\n    print(i * i)\n",
    "class Foo:\n    def __init__(self):\n        self.x = 1\n\n    def add(self, a, b):\n        return a + b\n",
    "print('hello world')\nprint('hello again')\n" * 3,
]


@pytest.fixture(scope="module")
def code_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("code")
    for i, text in enumerate(CODE):
        (d / f"m{i}.py").write_text(text)
    return d


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _args(tiny_target_dir, code_dir, out, *extra):
    return ["--target", str(tiny_target_dir), "--data", f"code-dir:{code_dir}?glob=*.py",
            "--split", "all", "--output-dir", str(out), "--quiet", *extra]


def test_build_all_kinds_and_load(tiny_target_dir, tiny_target, code_dir, tmp_path, monkeypatch, cache):
    monkeypatch.setattr("redraft.models.target.CACHE_ROOT", cache)  # token cache
    out = tmp_path / "ngrams"
    assert main(_args(tiny_target_dir, code_dir, out, "-k", "4", "-w", "3", "-t", "5", "--min-count", "1")) == 0
    tables = NGramTables.load(out, target=tiny_target)
    assert tables.kinds == ["unigram", "bigram", "extended", "trigram"]
    assert (tables.k, tables.w, tables.t) == (4, 3, 5)
    meta = json.loads((out / "ngrams.json").read_text())
    assert meta["tokenizer_fingerprint"] == tiny_target.fingerprint
    assert set(meta["build_seconds"]) == {"unigram", "bigram", "extended", "trigram"}
    assert meta["bigram"]["bos_prefix"] == 0  # <|endoftext|>: rows are p(· | [<|endoftext|>, x])
    n_tokens = sum(len(tiny_target.tokenizer(t)["input_ids"]) for t in CODE)
    assert meta["trigram"]["corpus"]["tokens"] == n_tokens
    # The most frequent successor of "print(" style contexts is what the corpus says it is.
    ids = tiny_target.tokenizer(CODE[3])["input_ids"]
    w1, w2 = torch.tensor(ids[:-2]), torch.tensor(ids[1:-1])
    succ, probs = tables.trigram_successors(w1, w2)
    assert bool((succ == torch.tensor(ids[2:])[:, None]).any(-1).all())  # every seen w3 is listed
    assert torch.all(probs[:, 0] > 0)


def test_sharded_build_then_merge_equals_single(tiny_target_dir, code_dir, tmp_path, monkeypatch, cache):
    monkeypatch.setattr("redraft.models.target.CACHE_ROOT", cache)  # token cache
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    assert main(_args(tiny_target_dir, code_dir, single, "--kinds", "trigram", "--min-count", "1")) == 0
    for i in range(2):
        assert main(_args(tiny_target_dir, code_dir, sharded, "--kinds", "trigram",
                          "--num-shards", "2", "--shard-id", str(i))) == 0
    assert main(["merge", "--output-dir", str(sharded), "--min-count", "1", "--quiet"]) == 0
    a = NGramTables.load(single).trigram_csr()
    b = NGramTables.load(sharded).trigram_csr()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    corpus = json.loads((sharded / "ngrams.json").read_text())["trigram"]["corpus"]
    assert corpus["records"] == len(CODE)


def test_bad_flags_exit_2_with_message(tiny_target_dir, code_dir, tmp_path, capsys):
    assert main(_args(tiny_target_dir, code_dir, tmp_path / "x", "--kinds", "bigram,fourgram")) == 2
    assert "fourgram" in capsys.readouterr().err
    assert main(_args(tiny_target_dir, code_dir, tmp_path / "x", "--num-shards", "2", "--shard-id", "2")) == 2
    assert "--shard-id 2" in capsys.readouterr().err
    assert main(["merge", "--output-dir", str(tmp_path / "empty")]) == 2
    assert "no shard counts" in capsys.readouterr().err


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--target", "--kinds", "--data", "--output-dir", "--min-count", "--num-shards",
                 "--shard-id", "--extend-with-model", "--memory-mb"):
        assert flag in text


def test_extended_added_later_chains_the_stored_bigram(tiny_target_dir, code_dir, tmp_path):
    out = tmp_path / "ngrams"
    assert main(_args(tiny_target_dir, code_dir, out, "--kinds", "bigram", "-k", "3")) == 0
    assert main(_args(tiny_target_dir, code_dir, out, "--kinds", "extended", "-w", "4")) == 0
    tables = NGramTables.load(out)
    assert tables.kinds == ["bigram", "extended"] and (tables.k, tables.w) == (3, 4)
    x = torch.arange(tables.vocab_size)
    ext, (ids, _) = tables.extended(x), tables.bigram_topk(x)
    assert torch.equal(ext[:, :, 0], ids)
    assert torch.equal(ext[:, :, 1], ids[:, 0][ids])  # the top-1 successor of each successor
