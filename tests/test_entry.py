"""redraft.entry: the console scripts whose self-distillation generates with redraft's engine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from redraft.entry import COMMANDS, distill_data_main

ROOT = Path(__file__).resolve().parents[1]


def test_the_distilling_console_scripts_are_the_entry_wrappers():
    text = (ROOT / "pyproject.toml").read_text()  # no tomllib: Python 3.10 is supported
    for name, fn in COMMANDS.items():
        assert f'\n{name} = "redraft.entry:{fn.__name__}"\n' in text


def test_redraft_distill_data_generates_with_the_engine(tiny_target_dir, tmp_path, capsys):
    src = tmp_path / "src.jsonl"
    chat = [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi"}]
    src.write_text(
        "".join(json.dumps({"id": f"c{i}", "conversations": chat}) + "\n" for i in range(3))
    )
    out = tmp_path / "out.jsonl"
    argv = ["--target", str(tiny_target_dir), "--data", f"sharegpt:{src}", "--output", str(out)]
    assert distill_data_main([*argv, "--max-new-tokens", "4", "--no-progress"]) == 0
    assert "with engine)" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 3


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_through_the_module_imports_no_torch(name):
    code = (
        f"import runpy, sys; sys.argv = ['redraft.entry', {name!r}, '--help']\n"
        "try:\n    runpy.run_module('redraft.entry', run_name='__main__')\n"
        "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "exit 0 False", out.stderr
    assert "usage:" in out.stdout


def test_the_module_finds_its_command_after_the_launchers_flags(monkeypatch):
    from redraft import entry

    seen = {}
    monkeypatch.setitem(entry.COMMANDS, "redraft-train", lambda argv: seen.setdefault("a", argv))
    assert entry.module_main(["--local_rank=0", "redraft-train", "--recipe", "tiny"]) == [
        "--local_rank=0",
        "--recipe",
        "tiny",
    ]
    assert entry.module_main(["--recipe", "tiny"]) == 2  # no command: usage, exit 2
