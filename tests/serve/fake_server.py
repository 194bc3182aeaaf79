"""A server over the fake engine in its own process, for the SIGTERM tests:

    python tests/serve/fake_server.py --step-delay 0.05 --grace 10

prints ``PORT <n>`` once it listens, then serves until SIGTERM (drain, exit 0) like redraft-serve.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fakes import FakeDecoder, FakeParams  # noqa: E402

from redraft.serve.app import create_app  # noqa: E402
from redraft.serve.server import bind, run  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--step-delay", type=float, default=0.05)
p.add_argument("--grace", type=float, default=10.0)
args = p.parse_args()
sock = bind("127.0.0.1", 0)
app = create_app(
    FakeDecoder(step_delay=args.step_delay, per_step=1),
    "fake",
    sampling_params=FakeParams,
    warmup=False,
)
print(f"PORT {sock.getsockname()[1]}", flush=True)
run(app, sock, grace_s=args.grace, log_level="warning")
print("EXITED CLEANLY", flush=True)
