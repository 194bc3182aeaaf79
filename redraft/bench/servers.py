"""Servers for the load test: the ``redraft-serve`` processes ``--spawn`` starts (with and without
speculation, an optional control), started on free ports and waited for until they answer."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time


def spawn_lines(args, also: list) -> list[tuple[str, str]]:
    """``(label, redraft-serve ARGS)`` of every server ``--spawn`` starts, the reference first:
    the scenario's pair, the ``--control`` copy of the reference, then each ``--also``."""
    if args.scenario == "long-join":
        lines = [("chunk-off", args.spawn + " --prefill-chunk 0"), ("chunk-auto", args.spawn)]
    else:
        lines = [("off", args.spawn + " --no-speculation"), ("on", args.spawn)]
    if args.control:
        lines.append((lines[0][0] + "2", lines[0][1]))
    return lines + list(also)


def spawn(args_line: str, api_key: str | None) -> tuple[subprocess.Popen, str]:
    """Start ``redraft-serve ARGS --port 0``; returns (process, base URL)."""
    cmd = [
        sys.executable,
        "-m",
        "redraft.serve.cli",
        *shlex.split(args_line),
        "--port",
        "0",
        "--log-level",
        "warning",
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if " on http://" not in line:
        proc.kill()
        raise RuntimeError(f"{' '.join(cmd)} did not start (exit {proc.wait()}): {line.strip()}")
    url = line.split(" on ", 1)[1].split()[0].removesuffix("/v1")
    return proc, url


def wait_ready(url: str, timeout: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}/health did not answer 200 within {timeout:.0f} s")
