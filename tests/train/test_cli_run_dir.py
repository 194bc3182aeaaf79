"""The run directory as the CLIs see it: a read-only path is one line, not a traceback;
``--resume`` needs something to resume; what a failed start leaves never blocks the retry."""

from __future__ import annotations

import errno
import os

import pytest

from redraft.train import cli


def _one_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


@pytest.fixture
def read_only(monkeypatch):
    """Paths under the returned directory are not writable (os.access says so, as it does on a
    read-only file system even for root)."""

    def make(root):
        real = os.access
        monkeypatch.setattr(
            cli.os,
            "access",
            lambda p, mode: False if str(p).startswith(str(root)) else real(p, mode),
        )
        return root

    return make


def test_cache_features_output_dir_on_a_read_only_path(tmp_path, read_only, capsys):
    ro = read_only(tmp_path / "ro")
    ro.mkdir()
    rc = cli.cache_features_main(["--recipe", "tiny", "--output-dir", str(ro / "features")])
    assert rc == 2
    line = _one_line(capsys, "redraft-cache-features")
    assert f"--output-dir {ro / 'features'}" in line and "not writable" in line


def test_train_data_cache_dir_on_a_read_only_path(tmp_path, read_only, capsys):
    ro = read_only(tmp_path / "ro")
    ro.mkdir()
    rc = cli.main(
        [
            "--recipe",
            "tiny",
            "--output-dir",
            str(tmp_path / "run"),
            "--data-cache-dir",
            str(ro / "cache"),
        ]
    )
    assert rc == 2
    assert "--data-cache-dir" in _one_line(capsys, "redraft-train")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod")
def test_a_real_read_only_directory(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert cli.cache_features_main(["--recipe", "tiny", "--output-dir", str(ro / "f")]) == 2
        assert "not writable" in _one_line(capsys, "redraft-cache-features")
    finally:
        ro.chmod(0o755)


def test_a_write_error_while_running_is_one_line(tmp_path, monkeypatch, capsys):
    """A path that turns read-only mid-run (or a full disk): the OSError becomes one line naming the file."""
    import redraft.train.features as features

    def boom(*a, **k):
        raise OSError(
            errno.EROFS, "Read-only file system", str(tmp_path / "f" / "shard-0.safetensors")
        )

    monkeypatch.setattr(features, "cache_features", boom)
    assert cli.cache_features_main(["--recipe", "tiny", "--output-dir", str(tmp_path / "f")]) == 2
    line = _one_line(capsys, "redraft-cache-features")
    assert "shard-0.safetensors" in line and "Read-only file system" in line


def test_resume_on_a_new_directory_is_refused(tmp_path, capsys):
    for out in (tmp_path / "new", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        assert cli.main(["--recipe", "tiny", "--output-dir", str(out), "--resume"]) == 2
        line = _one_line(capsys, "redraft-train")
        assert "--resume" in line and "no checkpoint" in line


def test_a_failed_start_never_blocks_the_retry(tmp_path, tiny_target_dir, chat_file, capsys):
    out = tmp_path / "run"
    common = [
        "--recipe",
        "tiny",
        "--target",
        str(tiny_target_dir),
        "--num-proc",
        "1",
        "--report-to",
        "none",
        "--output-dir",
        str(out),
        "--data-cache-dir",
        str(tmp_path / "cache"),
    ]
    rc = cli.main([*common, "--data", f"sharegpt:{tmp_path / 'missing.jsonl'}", "--max-steps", "1"])
    assert (
        rc == 2 and (out / "run_config.yaml").is_file()
    )  # the failed start left its config behind
    capsys.readouterr()
    # it holds nothing to resume either
    assert (
        cli.main([*common, "--data", f"sharegpt:{chat_file}", "--max-steps", "1", "--resume"]) == 2
    )
    assert "no checkpoint" in _one_line(capsys, "redraft-train")
    rc = cli.main([*common, "--data", f"sharegpt:{chat_file}", "--max-steps", "1"])
    assert rc == 0, capsys.readouterr().err[-2000:]
    assert (out / "model.safetensors").is_file()
    # a run that saved something still needs --resume or --overwrite
    assert cli.main([*common, "--data", f"sharegpt:{chat_file}", "--max-steps", "1"]) == 2
    assert "already holds a run" in capsys.readouterr().err
