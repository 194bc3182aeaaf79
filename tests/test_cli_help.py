"""Every console script answers ``--help`` quickly: exit 0, usage on stdout, and torch never
imported (a CLI imports its heavy stack inside ``main``, after the arguments are parsed); and
every one answers a mistyped flag or a missing argument with one line on stderr and exit 2."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from redraft.testing import declared_scripts

# name, module, attr of each console script (as ``importlib.metadata.EntryPoint`` names them)
SCRIPTS = [
    SimpleNamespace(name=name, module=value.partition(":")[0], attr=value.partition(":")[2])
    for name, value in sorted(declared_scripts().items())
]
# Runs the entry point as its console script would, and reports on exit whether torch was imported.
WRAPPER = """
import atexit, sys
atexit.register(lambda: sys.stderr.write("\\n[torch imported: %s]\\n" % ("torch" in sys.modules)))
from {module} import {attr} as main
sys.argv = [{name!r}, *{argv!r}]
sys.exit(main())
"""


def test_every_declared_script_is_checked():
    names = {ep.name for ep in SCRIPTS}
    assert {
        "redraft-train",
        "redraft-build-ngrams",
        "redraft-distill-data",
        "redraft-bench",
        "redraft-push",
        "redraft-demo",
    } <= names


def run(ep, *argv):
    code = WRAPPER.format(module=ep.module, attr=ep.attr, name=ep.name, argv=list(argv))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ep", SCRIPTS, ids=[ep.name for ep in SCRIPTS])
def test_help_exits_0_without_importing_torch(ep):
    out = run(ep, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:") and ep.name in out.stdout.splitlines()[0]
    assert "[torch imported: False]" in out.stderr, f"{ep.name} --help imported torch"


def _one_line_error(out) -> str:
    err = out.stderr.replace("\n[torch imported: False]\n", "").replace(
        "\n[torch imported: True]\n", ""
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# what each script requires (argparse names missing required arguments before unknown ones)
REQUIRED = {
    "redraft-build-ngrams": ["--output-dir", "x"],
    "redraft-cache-features": ["--output-dir", "x"],
    "redraft-distill-data": ["--output", "x"],
    "redraft-export": ["a", "b"],
    "redraft-push": ["a", "o/r"],
    "redraft-vllm": ["config"],
}


@pytest.mark.parametrize("ep", SCRIPTS, ids=[ep.name for ep in SCRIPTS])
def test_an_unknown_flag_is_one_line_and_exit_2(ep):
    err = _one_line_error(run(ep, *REQUIRED.get(ep.name, []), "--no-such-flag"))
    assert "--no-such-flag" in err and ep.name in err


@pytest.mark.parametrize("ep", [e for e in SCRIPTS if e.name in REQUIRED], ids=lambda e: e.name)
def test_a_missing_argument_is_one_line_and_exit_2(ep):
    err = _one_line_error(run(ep))
    assert "required" in err


@pytest.mark.parametrize("ep", SCRIPTS, ids=[ep.name for ep in SCRIPTS])
def test_a_flag_without_its_value_is_one_line_and_exit_2(ep):
    # every script has --help; the first option taking a value of each script is found from its parser
    import importlib

    # redraft.entry wraps these commands (it injects the engine); their parsers live here
    wrapped = {
        "redraft-train": "redraft.train.cli",
        "redraft-cache-features": "redraft.train.cli",
        "redraft-distill-data": "redraft.data.distill",
    }
    module = wrapped[ep.name] if ep.module == "redraft.entry" else ep.module
    mod = importlib.import_module(module)
    parser = mod.build_parser() if hasattr(mod, "build_parser") else None
    if parser is None:
        pytest.skip(f"{ep.module} has no build_parser()")
    flag = next(
        (
            a.option_strings[0]
            for a in parser._actions
            if a.option_strings
            and a.nargs is None
            and a.option_strings[0].startswith("--")
            and a.option_strings[0] != "--help"
            and getattr(a, "const", None) is None
            and type(a).__name__ == "_StoreAction"
        ),
        None,
    )
    if flag is None:
        pytest.skip(f"{ep.name} has no option taking a value")
    err = _one_line_error(run(ep, *REQUIRED.get(ep.name, []), flag))
    assert "expected one argument" in err and flag in err
