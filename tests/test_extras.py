"""The core decodes without the extras: with deepspeed, datasets, tensorboard (redraft[train])
and fastapi, uvicorn, prometheus-client (redraft[serve]) made unimportable, a decoder loads and
generates, and the commands that need an extra stop with one line naming it."""

import subprocess
import sys

from redraft.utils import EXTRAS

# every module an extra installs (and starlette, fastapi's) is None in sys.modules: importing it
# raises ModuleNotFoundError and importlib.util.find_spec says it is not installed
PRELUDE = f"""
import sys
sys.modules.update(dict.fromkeys({sorted({m for ms in EXTRAS.values() for m in ms} | {"starlette"})!r}))
"""


def run(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_a_decoder_loads_and_generates_without_the_extras(tiny_target_dir, tmp_path):
    out = run(
        f"""
from redraft.infer import load_decoder
dec = load_decoder({str(tiny_target_dir)!r}, dtype="float32", device="cpu", budget=4)
(gen,) = dec.generate([[1, 2, 3, 4]], max_new_tokens=6)
print(len(gen.tokens))
""",
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["6"]


def test_train_without_its_extra_names_it(tmp_path):
    code = "from redraft.commands import main; sys.exit(main(sys.argv[1:]))"

    def train(*argv):
        cmd = [sys.executable, "-c", PRELUDE + code, "train", "--recipe", "tiny", *argv]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert out.returncode == 2, out.stderr[-3000:]
        assert out.stderr.count("\n") == 1 and "pip install 'redraft[train]'" in out.stderr
        return out.stderr

    # the recipe's tracker is checked with the settings, before any work
    assert train("--output-dir", "a").startswith(
        "redraft train: error: --report-to tensorboard needs the tensorboard package"
    )
    assert train("--output-dir", "b", "--report-to", "none").startswith(
        "redraft train: error: redraft-train needs deepspeed, datasets"
    )


def test_serve_without_its_extra_names_it(tmp_path):
    out = run("from redraft.serve.cli import main; sys.exit(main(['--port', '0']))", tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "redraft-serve needs fastapi, uvicorn, prometheus_client" in out.stderr
    assert "pip install 'redraft[serve]'" in out.stderr


def test_a_missing_extra_is_named_only_when_needed():
    from redraft.utils import require_extra

    require_extra("train", "json", what="nothing")  # installed: no error
