"""The console scripts: bad input is one line on stderr and exit 2; --help is fast and honest."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from redraft.train.cli import build_cache_parser, build_parser
from redraft.train.config import recipe_names

BIN = Path(sys.executable).parent


def _cases(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    run = ["--recipe", "tiny", "--output-dir", str(tmp_path / "out")]
    cases = {
        "unknown flag": (
            ["redraft-train", "--bogus-flag", "1"],
            "unrecognized arguments: --bogus-flag",
        ),
        "missing value": (["redraft-train", "--lr"], "--lr: expected one argument"),
        "missing required": (["redraft-cache-features", "--recipe", "tiny"], "--output-dir"),
        "a value to a bare boolean": (
            ["redraft-train", "--rnn", "false"],
            "unrecognized arguments: false",
        ),
        "lr -1": (["redraft-train", *run, "--lr", "-1"], "--lr -1.0 is out of range: must be > 0"),
        "lr nan": (["redraft-train", *run, "--lr", "nan"], "--lr nan is out of range"),
        "lr text": (
            ["redraft-train", *run, "--lr", "fast"],
            "--lr 'fast' (lr in the command line) has the wrong type",
        ),
        "max-steps 0": (
            ["redraft-train", *run, "--max-steps", "0"],
            "--max-steps 0 is out of range: must be >= 1",
        ),
        "grad-accum 0": (
            ["redraft-train", *run, "--grad-accum", "0"],
            "--grad-accum 0 is out of range",
        ),
        "heldout 1.5": (
            ["redraft-train", *run, "--heldout-fraction", "1.5"],
            "--heldout-fraction 1.5 is out of range",
        ),
        "zero stage 4": (
            ["redraft-train", *run, "--zero-stage", "4"],
            "--zero-stage 4 is out of range",
        ),
        "report-to bogus": (
            ["redraft-train", *run, "--report-to", "bogus"],
            "'bogus' is not a tracker",
        ),
        "output-dir FILE": (
            ["redraft-train", "--recipe", "tiny", "--output-dir", str(a_file)],
            f"--output-dir {a_file} is a file",
        ),
        "output-dir under FILE": (
            ["redraft-train", "--recipe", "tiny", "--output-dir", str(a_file / "run")],
            "which is a file",
        ),
        "features missing": (
            ["redraft-train", *run, "--features", str(tmp_path / "none")],
            "redraft-cache-features",
        ),
        "cache top-k 0": (
            [
                "redraft-cache-features",
                "--recipe",
                "tiny",
                "--output-dir",
                str(tmp_path / "f"),
                "--top-k",
                "0",
            ],
            "--top-k 0 is out of range",
        ),
        "cache max-length 0": (
            [
                "redraft-cache-features",
                "--recipe",
                "tiny",
                "--output-dir",
                str(tmp_path / "f"),
                "--max-length",
                "0",
            ],
            "--max-length 0 is out of range",
        ),
    }
    if not torch.cuda.is_available():
        cases["device cuda without CUDA"] = (
            ["redraft-train", *run, "--device", "cuda"],
            "--device cuda: device 'cuda' was asked for but",
        )
    return cases


# run as real console scripts (subprocesses); the other cases go through the same main() in process
AS_SCRIPTS = {
    "unknown flag",
    "missing value",
    "missing required",
    "lr -1",
    "max-steps 0",
    "output-dir FILE",
    "device cuda without CUDA",
}


def _check(name, prog, code, err, expect):
    lines = err.strip().splitlines()
    assert code == 2, (name, err[-2000:])
    assert len(lines) == 1 and "Traceback" not in err, (name, err[-2000:])
    assert lines[0].startswith(f"{prog}: error: "), (name, lines[0])
    assert expect in lines[0], (name, lines[0])


def test_console_scripts_answer_bad_input_with_one_line_and_exit_2(tmp_path):
    cases = {k: v for k, v in _cases(tmp_path).items() if k in AS_SCRIPTS}
    procs = {
        name: subprocess.Popen(
            [str(BIN / argv[0]), *argv[1:]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for name, (argv, _) in cases.items()
    }  # all at once: each pays Python's start-up
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        _check(name, cases[name][0][0], p.returncode, err, cases[name][1])
    assert not (tmp_path / "out").exists()  # refused before any work


def test_every_other_bad_value_is_one_line_and_exit_2(tmp_path, capsys):
    from redraft.train.cli import cache_features_main, main

    mains = {"redraft-train": main, "redraft-cache-features": cache_features_main}
    for name, (argv, expect) in _cases(tmp_path).items():
        if name in AS_SCRIPTS:
            continue
        try:
            code = mains[argv[0]](argv[1:])
        except SystemExit as exc:  # argparse errors exit through our one-line error()
            code = exc.code
        _check(name, argv[0], code, capsys.readouterr().err, expect)
    assert not (tmp_path / "out").exists() and not (tmp_path / "f").exists()


def test_help_is_fast_lists_every_recipe_and_shows_each_default_once():
    probe = "import sys, redraft.train.cli; sys.exit(3 if 'torch' in sys.modules else 0)"
    assert (
        subprocess.run([sys.executable, "-c", probe]).returncode == 0
    )  # no torch at import: --help is instant
    text = build_parser().format_help()
    flat = " ".join(text.split())
    for name in recipe_names():
        assert name in flat
    assert "demo" in recipe_names()
    assert "--rnn, --no-rnn" in text and "--pack, --no-pack" in text and "{true,false}" not in text
    assert "(default: None)" not in text and "[default" not in text
    assert flat.count("(default: 0.001)") == 1  # --lr: from the default recipe, printed once
    assert (
        "(default: 16)" in flat
    )  # --grad-accum: the default recipe's value, not the dataclass's 8
    cache = " ".join(build_cache_parser().format_help().split())
    assert "--top-k K" in cache and "(default: 8)" in cache and "--lr" not in cache


@pytest.mark.parametrize(
    "flags,key,value",
    [
        (["--no-rnn"], "rnn", False),
        (["--pack"], "pack", True),
        (["--no-group-by-length"], "group_by_length", False),
        (["--report-to", "none"], "trackers", []),
        (["--set", "tensorboard=false"], "trackers", []),
        (["--report-to", "tensorboard"], "trackers", ["tensorboard"]),
    ],
)
def test_boolean_flags_are_bare_and_old_spellings_still_work(flags, key, value):
    from redraft.train.cli import config_from_args
    from redraft.train.config import parse_report_to

    cfg = config_from_args(build_parser().parse_args(["--recipe", "tiny", *flags]))
    got = parse_report_to(cfg.report_to) if key == "trackers" else getattr(cfg, key)
    assert got == value
