"""redraft installs like a package: a wheel carries its recipes and presets (redraft/configs), and
its CLIs run from any directory, writing their default outputs relative to the working directory.

The wheel is built from a copy of the sources (nothing written into the checkout) and installed
into a fresh venv. That venv reuses this one's installed dependencies (a folder of links to
them, named in a .pth file) but not the editable redraft, so the wheel is the only redraft it
can import; nothing is downloaded.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from redraft.resources import config_dir, find_config

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "redraft")


def run(cmd, cwd, **kw):
    out = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=300, **kw
    )
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in SOURCES:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        copy(
            REPO / name,
            src / name,
            **({"symlinks": True, "ignore": ignore} if copy is shutil.copytree else {}),
        )
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            tmp / "dist",
            src,
        ],
        cwd=tmp,
    )
    (whl,) = (tmp / "dist").glob("redraft-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed and this venv's dependencies on its path.

    The dependencies come through a .pth line naming this venv's site-packages; the .pth files
    there are not processed, so the editable redraft's import hook is not installed and the
    wheel is the only redraft that imports.
    """
    tmp = tmp_path_factory.mktemp("venv")
    env = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env], check=True)
    py = env / "bin" / "python"
    env_site = Path(
        run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp
        ).stdout.strip()
    )
    (env_site / "redraft-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            py,
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            wheel,
        ],
        cwd=tmp,
    )
    return env


def test_wheel_holds_every_module_and_the_shipped_files(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "redraft").rglob("*.py")
        if "__pycache__" not in p.parts and "configs" not in p.parts
    }
    assert sources <= names, sorted(sources - names)
    for stage in ("train", "infer"):
        shipped = {
            f"redraft/configs/{stage}/{p.relative_to(REPO / stage).as_posix()}"
            for p in (REPO / stage).rglob("*")
            if p.suffix in (".yaml", ".json")
        }
        assert shipped and shipped <= names, sorted(shipped - names)
    assert "redraft/configs/train/recipes/tiny.yaml" in names and "redraft/hub/card.md" in names
    # development tooling (dev/: the GPU harness, profiling helpers), tests and docs stay out
    tops = {n.split("/", 1)[0] for n in names}
    assert not tops & {"dev", "tests", "docs", "benchmarks", "scripts"}, sorted(tops)


def test_editable_install_reads_the_checkout_folders():
    assert config_dir("train").samefile(REPO / "train") and config_dir("infer").samefile(
        REPO / "infer"
    )
    assert find_config("infer/bench-default.yaml", "infer").samefile(
        REPO / "infer" / "bench-default.yaml"
    )
    assert find_config("decode-default", "infer").samefile(REPO / "infer" / "decode-default.yaml")
    with pytest.raises(Exception, match=r"'nope' is neither an existing file.*bench-default.yaml"):
        find_config("nope", "infer")


def test_installed_wheel_runs_from_another_directory(venv, tmp_path):
    from redraft.testing import make_tiny_target_dir

    target = make_tiny_target_dir(tmp_path / "tiny-target")
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"c{i}",
                    "conversations": [
                        {"from": "human", "value": f"count from {i}"},
                        {"from": "gpt", "value": " ".join(["one two three"] * 3)},
                    ],
                }
            )
            + "\n"
            for i in range(24)
        )
    )
    work = tmp_path / "work"
    work.mkdir()
    bin_dir = venv / "bin"
    # a fresh shell's environment: not this venv's, and not the distributed variables an in-process
    # train() of an earlier test left behind (the child would join that world's port: EADDRINUSE)
    dist = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", *dist)}
    env.update(DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", REDRAFT_CACHE=str(tmp_path / "cache"))

    where = run(
        [
            bin_dir / "python",
            "-c",
            "import redraft, redraft.resources as r; "
            "print(redraft.__file__); print(r.config_dir('train'))",
        ],
        work,
        env=env,
    ).stdout.split()
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    assert all(Path(p).is_relative_to(site) for p in where), where  # the wheel, not the checkout

    assert "--recipe" in run([bin_dir / "redraft-train", "--help"], work, env=env).stdout
    run(
        [
            bin_dir / "redraft-train",
            "--recipe",
            "tiny",
            "--target",
            target,
            "--data",
            f"sharegpt:{chats}",
            "--max-steps",
            "2",
            "--num-proc",
            "1",
            "--data-cache-dir",
            tmp_path / "dc",
        ],
        work,
        env=env,
    )
    run_dir = work / "checkpoints" / "redrafter-tiny-target"  # the default output, under the cwd
    assert (run_dir / "model.safetensors").is_file()
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "completed"
    assert not list(site.rglob("checkpoints")) and not list(site.rglob("metrics.json"))

    # The shipped benchmark recipe by its repository path, from a directory that has no infer/.
    listed = run(
        [
            bin_dir / "redraft-bench",
            "--recipe",
            "infer/bench-default.yaml",
            "--target",
            target,
            "--list-methods",
        ],
        work,
        env=env,
    ).stdout.split()
    assert "greedy" in listed
