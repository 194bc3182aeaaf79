"""``redraft <command>``: the same main as the console script ``redraft-<command>``, the same
help (its usage names ``redraft <command>``), a listing of the commands, and one-line errors."""

import subprocess
import sys

import pytest

from redraft.commands import COMMANDS
from redraft.testing import declared_scripts

# Runs a console script's main as the script would, and reports whether torch was imported.
WRAPPER = """
import atexit, sys
atexit.register(lambda: sys.stderr.write("\\n[torch imported: %s]\\n" % ("torch" in sys.modules)))
from {module} import {attr} as main
sys.argv = [{name!r}, *{argv!r}]
sys.exit(main())
"""


def run(target: str, name: str, *argv: str) -> subprocess.CompletedProcess:
    module, _, attr = target.partition(":")
    code = WRAPPER.format(module=module, attr=attr, name=name, argv=list(argv))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def redraft(*argv: str) -> subprocess.CompletedProcess:
    return run("redraft.commands:main", "redraft", *argv)


def test_every_command_is_a_declared_script_with_the_same_main():
    scripts = declared_scripts()
    assert scripts["redraft"] == "redraft.commands:main"
    for name, (target, _) in COMMANDS.items():
        assert scripts[f"redraft-{name}"] == target, name
    # and every redraft-* script is a command
    assert {s.removeprefix("redraft-") for s in scripts if s != "redraft"} == set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_help_is_the_scripts_help(name):
    script = run(COMMANDS[name][0], f"redraft-{name}", "--help")
    sub = redraft(name, "--help")
    assert sub.returncode == script.returncode == 0, sub.stderr[-2000:]
    assert sub.stdout.splitlines()[0].startswith(f"usage: redraft {name}")
    # the same text but for the name its usage gives it (the description names the script)
    script_usage = script.stdout.split("\n\n")[0].replace(f"redraft-{name}", f"redraft {name}")
    assert sub.stdout.split("\n\n")[0] == script_usage
    assert sub.stdout.split("\n\n")[1:] == script.stdout.split("\n\n")[1:]
    assert "[torch imported: False]" in sub.stderr


def test_help_lists_every_command_with_its_line_and_imports_none():
    out = redraft("--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: redraft <command>")
    for name, (_, line) in COMMANDS.items():
        assert f"  {name} " in out.stdout and line in out.stdout
    assert "[torch imported: False]" in out.stderr
    code = "import sys; from redraft.commands import main; main(['--help']); " + (
        "print(sorted(m for m in sys.modules if m.startswith('redraft.')))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    # the package, its Auto-class hook and the shared modules the listing needs; no command's
    assert loaded.stdout.splitlines()[-1] == str(
        [
            "redraft.commands",
            "redraft.errors",
            "redraft.models",
            "redraft.models.auto",
            "redraft.utils",
        ]
    )


def test_an_unknown_command_is_one_line_naming_the_commands():
    out = redraft("trian")
    assert out.returncode == 2
    err = out.stderr.replace("\n[torch imported: False]\n", "")
    assert err.count("\n") == 1 and "'trian'" in err
    assert all(name in err for name in COMMANDS)


def test_no_command_prints_the_listing_and_exits_2():
    out = redraft()
    assert out.returncode == 2 and "commands:" in out.stderr


def test_version():
    from redraft import __version__

    out = redraft("--version")
    assert out.returncode == 0 and out.stdout == f"redraft {__version__}\n"


def test_a_commands_errors_name_it_as_typed():
    err = redraft("push", "a", "o/r", "--no-such-flag").stderr
    assert err.startswith("redraft push: error: unrecognized arguments: --no-such-flag")
    err = redraft("build-ngrams", "merge", "--no-such-flag").stderr
    assert err.startswith("redraft build-ngrams merge: error:")
