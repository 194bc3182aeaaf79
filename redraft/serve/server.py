"""Running the app under uvicorn: bind first, drain on SIGTERM.

* :func:`bind` opens the listening socket before the model loads, so a busy port is a one-line
  error and not a failure after a minute of loading; port 0 picks a free port (tests).
* :class:`DrainingServer` is ``uvicorn.Server`` that, on SIGTERM/SIGINT, first tells the
  scheduler to refuse new requests (503) and then lets uvicorn do its graceful shutdown: stop
  accepting connections, wait up to ``timeout_graceful_shutdown`` seconds for in-flight requests
  (streams included) to finish, cancel what is left, run the app's shutdown (the decode loop
  stops).
"""

from __future__ import annotations

import signal
import socket

import uvicorn


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6); raises ``OSError`` if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose exit signal first puts the app's scheduler into draining mode."""

    def handle_exit(self, sig, frame) -> None:
        scheduler = getattr(getattr(self.config.app, "state", None), "scheduler", None)
        if scheduler is not None:
            scheduler.drain()
        super().handle_exit(sig, frame)


def make_server(app, grace_s: float = 30.0, log_level: str = "info") -> DrainingServer:
    config = uvicorn.Config(
        app,
        timeout_graceful_shutdown=grace_s,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_keep_alive=5,
    )
    return DrainingServer(config)


def run(app, sock: socket.socket, grace_s: float = 30.0, log_level: str = "info") -> None:
    """Serve ``app`` on ``sock`` until SIGTERM/SIGINT, then drain (see the module doc).

    uvicorn re-raises the signal it caught once it has shut down; for SIGTERM that would turn a
    clean drain into a death by signal, so SIGTERM's handler is a no-op by then (exit status 0).
    """
    signal.signal(signal.SIGTERM, lambda *_: None)
    make_server(app, grace_s, log_level).run(sockets=[sock])
