"""redraft-build-ngrams end to end on the tiny target and a tiny code corpus."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from redraft.ngrams import NGramTables
from redraft.ngrams.cli import main
from redraft.ngrams.trigrams import SpillDir, clean_stale_spills

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
    return [
        "--target",
        str(tiny_target_dir),
        "--data",
        f"code-dir:{code_dir}?glob=*.py",
        "--split",
        "all",
        "--output-dir",
        str(out),
        "--quiet",
        *extra,
    ]


def test_build_all_kinds_and_load(
    tiny_target_dir, tiny_target, code_dir, tmp_path, monkeypatch, cache
):
    monkeypatch.setattr("redraft.models.target.CACHE_ROOT", cache)  # token cache
    out = tmp_path / "ngrams"
    assert (
        main(
            _args(
                tiny_target_dir, code_dir, out, "-k", "4", "-w", "3", "-t", "5", "--min-count", "1"
            )
        )
        == 0
    )
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


def _our_lines(err: str) -> list[str]:
    """stderr without transformers' weight-loading progress bar (written with carriage returns)."""
    return [line for line in err.splitlines() if line.strip() and "Loading weights" not in line]


def _same_table(a, b):
    a, b = NGramTables.load(a).trigram, NGramTables.load(b).trigram
    for name in ("context_keys", "offsets", "ids", "probs", "context_counts"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_sharded_build_then_merge_equals_single(
    tiny_target_dir, tiny_target, code_dir, tmp_path, monkeypatch, cache
):
    monkeypatch.setattr("redraft.models.target.CACHE_ROOT", cache)  # token cache
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    assert (
        main(_args(tiny_target_dir, code_dir, single, "--kinds", "trigram", "--min-count", "1"))
        == 0
    )
    for i in range(2):
        assert (
            main(
                _args(
                    tiny_target_dir,
                    code_dir,
                    sharded,
                    "--kinds",
                    "trigram",
                    "--num-shards",
                    "2",
                    "--shard-id",
                    str(i),
                )
            )
            == 0
        )
    assert main(["merge", "--output-dir", str(sharded), "--min-count", "1", "--quiet"]) == 0
    _same_table(single, sharded)
    meta = json.loads((sharded / "ngrams.json").read_text())
    assert meta["trigram"]["corpus"]["records"] == len(CODE)
    # the merged artifact records its target and how it was built, like a single build
    assert meta["target_vocab_size"] == tiny_target.vocab_size
    assert meta["target_hidden_size"] == tiny_target.hidden_size
    args = meta["build_args"]["trigram"]
    assert (args["num_shards"], args["min_count"], args["split"]) == (2, 1, "all")
    assert args["data"] == f"code-dir:{code_dir}?glob=*.py"
    # ... and holds one artifact: the shard counts moved out, where a re-merge finds them
    assert not list(sharded.glob("trigram-counts-*"))
    moved = sorted(p.name for p in (tmp_path / "sharded.shards").iterdir())
    assert moved == ["trigram-counts-00000-of-00002", "trigram-counts-00001-of-00002"]
    assert main(["merge", "--output-dir", str(sharded), "--min-count", "1", "--quiet"]) == 0
    _same_table(single, sharded)


def test_merge_refuses_a_shard_changed_at_the_same_size(
    tiny_target_dir, code_dir, tmp_path, monkeypatch, cache, capsys
):
    monkeypatch.setattr("redraft.models.target.CACHE_ROOT", cache)
    out = tmp_path / "sharded"
    for i in range(2):
        assert (
            main(
                _args(
                    tiny_target_dir,
                    code_dir,
                    out,
                    "--kinds",
                    "trigram",
                    "--num-shards",
                    "2",
                    "--shard-id",
                    str(i),
                )
            )
            == 0
        )
    counts = out / "trigram-counts-00001-of-00002" / "counts.bin"
    data = bytearray(counts.read_bytes())
    data[0] ^= 1  # a count off by one: same size, a different table
    counts.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["merge", "--output-dir", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "counts.bin does not match the sha256" in err and "shard_id 1" in err
    assert err.count("\n") == 1 and not (out / "ngrams.json").exists()


def _spill_of_a_killed_build(root):
    """A spill folder whose owner was SIGKILLed (its flock released by the kernel)."""
    code = (
        "import os, sys; from redraft.ngrams.trigrams import SpillDir; d = SpillDir(sys.argv[1]); "
        "(d.path / 'run-00000').mkdir(); print(d.path, flush=True); os.kill(os.getpid(), 9)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True)
    assert out.returncode == -9, out.stderr
    path = Path(out.stdout.strip())
    assert path.is_dir()
    return path


def test_stale_spills_are_removed_and_live_ones_kept(tmp_path):
    dead = _spill_of_a_killed_build(tmp_path)
    live = SpillDir(tmp_path)  # this process holds its lock
    assert clean_stale_spills(tmp_path) == [dead]
    assert not dead.exists() and live.path.is_dir()
    live.cleanup()
    assert not live.path.exists()


def test_a_build_into_the_same_output_removes_a_killed_builds_spill(
    tiny_target_dir, code_dir, tmp_path, monkeypatch, cache
):
    monkeypatch.setattr("redraft.models.target.CACHE_ROOT", cache)
    out = tmp_path / "ngrams"
    out.mkdir()
    dead = _spill_of_a_killed_build(out)
    assert (
        main(_args(tiny_target_dir, code_dir, out, "--kinds", "trigram", "--min-count", "1")) == 0
    )
    assert not dead.exists()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, "error"])
def test_ctrl_c_or_an_error_while_merging_spilled_runs_leaves_no_spill(
    tiny_target_dir, code_dir, tmp_path, monkeypatch, cache, capsys, interrupt
):
    monkeypatch.setattr("redraft.models.target.CACHE_ROOT", cache)
    from redraft.errors import DataError
    from redraft.ngrams import trigrams

    seen = {}

    def stop(counts, **kw):  # the final merge of the spilled runs, interrupted
        seen["spilled"] = [p for p in counts.spilled if p.exists()]
        raise KeyboardInterrupt if interrupt is KeyboardInterrupt else DataError("boom")

    monkeypatch.setattr(trigrams, "build_trigram_table", stop)
    out = tmp_path / "ngrams"
    rc = main(
        _args(
            tiny_target_dir,
            code_dir,
            out,
            "--kinds",
            "trigram",
            "--memory-mb",
            "0",
            "--chunk-tokens",
            "40",
        )
    )
    err = capsys.readouterr().err
    assert rc == (130 if interrupt is KeyboardInterrupt else 2)
    assert len(seen["spilled"]) > 1  # it had spilled
    ours = _our_lines(err)
    assert (
        len(ours) == 1 and ours[0].startswith("redraft-build-ngrams: ") and "Traceback" not in err
    )
    assert not any(p.exists() for p in seen["spilled"])
    assert not list(out.glob(".trigram-spill-*"))


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--kinds", "bigram,fourgram"], "fourgram"),
        (["--num-shards", "2", "--shard-id", "2"], "--shard-id 2 is not in 0..1"),
        (["--num-shards", "0"], "--num-shards 0 is out of range: it must be at least 1"),
        (["--limit", "-5"], "--limit -5 is out of range: it must be at least 1"),
        (["-k", "0"], "-k 0 is out of range"),
        (["--min-count", "0"], "--min-count 0"),
        (["--data", "nosuchkind:x", "--kinds", "trigram"], "Unknown data source 'nosuchkind:x'"),
    ],
)
def test_bad_flags_exit_2_with_one_line_before_any_work(
    tiny_target_dir, code_dir, tmp_path, capsys, monkeypatch, extra, message
):
    def no_load(*a, **kw):
        raise AssertionError("the target was loaded before the arguments were checked")

    monkeypatch.setattr("redraft.models.load_target", no_load)
    assert main(_args(tiny_target_dir, code_dir, tmp_path / "x", *extra)) == 2
    err = capsys.readouterr().err
    assert (
        message in err and err.count("\n") == 1 and err.startswith("redraft-build-ngrams: error:")
    )


def test_output_dir_that_is_a_file_fails_before_any_work(
    tiny_target_dir, code_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr("redraft.models.load_target", lambda *a, **kw: pytest.fail("loaded"))
    f = tmp_path / "file"
    f.write_text("x")
    assert main(_args(tiny_target_dir, code_dir, f)) == 2
    assert f"--output-dir {f} is an existing file" in capsys.readouterr().err
    assert main(["merge", "--output-dir", str(f)]) == 2
    assert "is an existing file" in capsys.readouterr().err
    assert main(["merge", "--output-dir", str(tmp_path / "empty")]) == 2
    assert "no shard counts" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only torch")
def test_cuda_without_cuda_is_one_line(tiny_target_dir, code_dir, tmp_path, capsys):
    assert main(_args(tiny_target_dir, code_dir, tmp_path / "x", "--device", "cuda")) == 2
    err = capsys.readouterr().err
    assert "device 'cuda'" in err and "--device cpu" in err
    assert len(_our_lines(err)) == 1


def test_k_and_t_above_the_vocabulary_are_refused(tiny_target_dir, code_dir, tmp_path, capsys):
    for flag in ("-k", "-t"):
        assert main(_args(tiny_target_dir, code_dir, tmp_path / "x", flag, "100000")) == 2
        err = capsys.readouterr().err
        assert f"{flag} 100000 is above the target's vocabulary size 384: choose 1..384" in err
    assert not (tmp_path / "x" / "ngrams.json").exists()


def test_help_lists_every_flag_with_each_default_once(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--target",
        "--kinds",
        "--data",
        "--output-dir",
        "--min-count",
        "--num-shards",
        "--shard-id",
        "--extend-with-model, --no-extend-with-model",
        "--memory-mb",
        "--overwrite, --no-overwrite",
        "--quiet, --no-quiet",
    ):
        assert flag in text
    assert "(default: None)" not in text and text.count("(default: 25)") == 1
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    assert "--keep-shards, --no-keep-shards" in capsys.readouterr().out


def test_cli_module_imports_no_torch():
    code = "import sys, redraft.ngrams.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


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


def _chat_lines(n: int) -> list[str]:
    conv = [
        {"from": "human", "value": "count from one"},
        {"from": "gpt", "value": "one two three four five six"},
    ]
    return [json.dumps({"id": f"c{i}", "conversations": conv}) for i in range(n)]


def test_skipped_records_are_reported(tiny_target_dir, tmp_path, monkeypatch, capsys, caplog):
    """Malformed records of --data are counted by reason and reported, as redraft-train does."""
    monkeypatch.setattr("redraft.models.target.CACHE_ROOT", tmp_path / "cache")
    data = tmp_path / "mixed.jsonl"
    bad = [
        "{not json",
        json.dumps({"id": "e", "conversations": [{"from": "human", "value": ""}]}),
        "[1, 2]",
    ]
    data.write_text("\n".join(_chat_lines(5) + bad) + "\n")
    args = [
        "--target",
        str(tiny_target_dir),
        "--kinds",
        "trigram",
        "--data",
        f"sharegpt:{data}",
        "--split",
        "all",
        "--output-dir",
        str(tmp_path / "out"),
        "--min-count",
        "1",
        "--quiet",
    ]
    with caplog.at_level("WARNING", logger="redraft.ngrams"):
        assert main(args) == 0
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "kept 5 records, skipped 3" in lines[0], lines
    assert "invalid_json 1" in lines[0] and "not_an_object 1" in lines[0]


def test_an_all_bad_corpus_is_a_clear_error(tiny_target_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("redraft.models.target.CACHE_ROOT", tmp_path / "cache")
    data = tmp_path / "bad.jsonl"
    empty = json.dumps({"id": "e", "conversations": [{"from": "human", "value": ""}]})
    data.write_text(f'{{"id": "x", "conversations": []}}\n[1]\n{{not json\n{empty}\n')
    out = tmp_path / "out"
    rc = main(
        [
            "--target",
            str(tiny_target_dir),
            "--kinds",
            "trigram",
            "--data",
            f"sharegpt:{data}",
            "--split",
            "all",
            "--output-dir",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 2
    err = [line for line in _our_lines(capsys.readouterr().err) if "error" in line]
    assert (
        len(err) == 1 and "no usable record" in err[0] and "every record was skipped" in err[0]
    ), err
    assert "invalid_json 1" in err[0] and "not_an_object 1" in err[0] and str(data) in err[0]
    assert not (out / "ngrams.json").exists()
