"""Process-level behaviour: SIGTERM drains in-flight requests (and cuts them after the grace
period), a draining server answers 503, the CLI's --help imports no torch, a busy port is a
one-line error before any model loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fakes import expected

pytestmark = pytest.mark.timeout(120)
HERE = Path(__file__).parent


def start_fake(grace: float, step_delay: float = 0.05):
    proc = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "fake_server.py"),
            "--grace",
            str(grace),
            "--step-delay",
            str(step_delay),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("PORT "), line + proc.stderr.read()
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


def stream_in_thread(url, prompt, max_tokens, out: dict, started: threading.Event):
    def go():
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
        lines = []
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()
        except httpx.HTTPError as exc:
            out["error"] = exc
        out["lines"] = lines

    t = threading.Thread(target=go)
    t.start()
    return t


def text_of(lines):
    return "".join(
        json.loads(x[6:])["choices"][0]["text"] for x in lines if x.startswith("data: {")
    )


def test_sigterm_finishes_in_flight_requests_then_exits_0():
    proc, url = start_fake(grace=30)
    try:
        outs, threads = [{}, {}], []
        for i, out in enumerate(outs):
            started = threading.Event()
            threads.append(stream_in_thread(url, f"req{i}", 30, out, started))
            assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no new connections while draining
            httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
        for t in threads:
            t.join(60)
        for i, out in enumerate(outs):
            assert out["lines"][-1] == "data: [DONE]"
            assert text_of(out["lines"]) == expected(f"req{i}", 30)[0]  # complete, nothing lost
        assert proc.wait(30) == 0
        assert "EXITED CLEANLY" in proc.stdout.read()
    finally:
        proc.kill()


def test_sigterm_cuts_requests_after_the_grace_period():
    proc, url = start_fake(grace=0.5)
    try:
        out, started = {}, threading.Event()
        t = stream_in_thread(
            url, "long", 90, out, started
        )  # 90 steps x 0.05 s: longer than the grace
        assert started.wait(30)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert time.monotonic() - t0 < 4.0  # cut after the grace period; 90 steps would take 4.5 s
        assert (
            proc.wait(30) == 0
        )  # (interpreter exit after importing torch takes seconds on a busy machine)
        assert "data: [DONE]" not in out["lines"]
        assert len(text_of(out["lines"])) < 90
    finally:
        proc.kill()


def test_draining_server_answers_503(fake_server):
    url, _, app = fake_server()
    app.state.scheduler.drain()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert httpx.get(f"{url}/health").status_code == 503


def test_cli_help_imports_no_torch():
    code = (
        "import sys\nfrom redraft.serve.cli import build_parser\nbuild_parser().format_help()\n"
        "assert not any(m in sys.modules for m in ('torch', 'transformers', 'fastapi')), 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_cli_busy_port_is_one_line_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "redraft.serve.cli",
                "--port",
                str(port),
                "--target",
                "/nonexistent",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k != "REDRAFT_API_KEY"},
        )
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--max-batch", "0"], "--max-batch"),
        (["--port", "70000"], "--port"),
        (["--grace", "-1"], "--grace"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_cli_rejects_bad_arguments_before_loading(argv, msg):
    from redraft.serve.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_cli_prefill_flags_reach_the_decoder(tiny_target_dir):
    from redraft.serve.cli import build_parser, load

    args = build_parser().parse_args(
        ["--target", str(tiny_target_dir), "--prefill-share", "2.5", "--prefill-chunk", "64"]
    )
    dec = load(args)
    assert dec.config.prefill_share == 2.5 and dec.config.prefill_chunk == 64
    assert dec.engine()._pacer.share == 2.5


def test_the_server_freezes_the_heap_it_loaded_unless_told_not_to():
    """``gc.freeze`` after loading: the collector's full collections no longer scan the model's
    and libraries' objects (0.3 s pauses inside decode steps before)."""
    import gc

    from redraft.serve.cli import build_parser, check_args, freeze_heap

    def parsed(argv):
        parser = build_parser()
        args = parser.parse_args(argv)
        check_args(args, parser)  # fills in the server's defaults
        return args

    assert parsed([]).gc_freeze is True and parsed(["--no-gc-freeze"]).gc_freeze is False
    junk = [[i] for i in range(1000)]  # alive now: frozen with the rest
    try:
        frozen = freeze_heap()
        # (another thread of the test process may free a few frozen objects in between: the
        # count only falls by those, 22 of 713,102 in one full run)
        assert len(junk) < frozen and 0 <= frozen - gc.get_freeze_count() < frozen // 100
        assert not any(o is junk for o in gc.get_objects())  # no longer scanned
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0 and any(o is junk for o in gc.get_objects())


def test_the_compute_thread_runs_calls_in_order_and_outlives_their_errors():
    from redraft.serve.scheduler import ComputeThread

    compute, seen = ComputeThread(), []
    first = compute.submit(lambda: seen.append(threading.get_ident()) or "a")
    with pytest.raises(ZeroDivisionError):
        compute.call(lambda: 1 / 0)
    assert compute.call(lambda x, y=0: seen.append(threading.get_ident()) or x + y, 2, y=3) == 5
    assert first.result() == "a"
    assert seen == [compute.ident, compute.ident] and compute.ident != threading.get_ident()


def test_redraft_serve_decodes_on_the_thread_that_loaded_its_decoder(monkeypatch):
    """PyTorch's OpenMP team belongs to the thread that opened it: a model loaded on the main
    thread and decoded on another made every step 1.2-1.5x slower on a small CPU
    (``ComputeThread``'s doc). The server loads and decodes on one thread."""
    from fakes import FakeDecoder

    import redraft.serve.cli as cli
    import redraft.serve.server as server

    where = {}

    class Recording(FakeDecoder):
        def engine(self):
            where["engine"] = threading.get_ident()
            return super().engine()

    def load(args):
        where["load"] = threading.get_ident()
        return Recording()

    def run(app, sock, **kw):  # start the decode loop (the app's start-up), then stop it
        sched = app.state.scheduler
        sched.start()
        assert sched.ready.wait(30) and sched.failure is None
        sched.stop()
        sock.close()

    monkeypatch.setattr(cli, "load", load)
    monkeypatch.setattr(server, "run", run)
    parser = cli.build_parser()
    args = parser.parse_args(["--port", "0", "--no-warmup", "--no-gc-freeze"])
    cli.check_args(args, parser)
    assert cli.serve(args) == 0
    assert where["engine"] == where["load"] != threading.get_ident()
