"""Live servers for the tests: uvicorn on 127.0.0.1, a port the OS picks (bound before the
server starts, so there is no race), in a thread of the test process; stopped at the end."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # fakes.py

from fakes import FakeDecoder, FakeParams  # noqa: E402

START_TIMEOUT_S = 60


@contextlib.contextmanager
def live_server(app, grace_s: float = 5.0):
    """Serve ``app``; yields its base URL (``http://127.0.0.1:PORT``)."""
    from redraft.serve.server import bind, make_server

    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = make_server(app, grace_s=grace_s, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture
def fake_server():
    """A factory: ``url, decoder, app = fake_server(step_delay=..., **create_app kwargs)``."""
    from redraft.serve.app import create_app

    with contextlib.ExitStack() as stack:

        def start(step_delay: float = 0.0, per_step: int = 2, **kw):
            kw.setdefault("warmup", False)
            dec = FakeDecoder(step_delay=step_delay, per_step=per_step)
            app = create_app(dec, "fake", sampling_params=FakeParams, **kw)
            return stack.enter_context(live_server(app)), dec, app

        yield start
