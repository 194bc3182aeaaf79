"""``redraft-serve``: the speculative decoder behind an OpenAI-compatible HTTP API.

    redraft-serve --preset infer/decode-default.yaml                      # make serve
    redraft-serve --target default --ngrams checkpoints/ngrams-smollm2 --port 8000 --api-key "$KEY"
    redraft-serve --target meta-llama/Llama-3.1-8B-Instruct --dtype bfloat16 --device cuda \\
        --drafter my-org/redrafter-llama3 --max-batch 32

Then ``curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json'
-d '{"messages": [{"role": "user", "content": "Hi!"}]}'`` or any OpenAI client with
``base_url="http://127.0.0.1:8000/v1"``. See docs/serve.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from redraft.utils import ArgumentParser, HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="redraft-serve", description="The speculative decoder behind an OpenAI-compatible HTTP API (docs/serve.md).",
                                formatter_class=HelpFormatter)
    m = p.add_argument_group("model (flags override the preset's keys)")
    m.add_argument("--preset", default=None,
                   help="decoding preset YAML (load_decoder arguments), e.g. infer/decode-default.yaml")
    m.add_argument("--target", default=None,
                   help="target model: 'default', a hub id[@rev], a local dir or a GGUF file "
                        "(default: the preset's, else 'default')")
    m.add_argument("--drafter", action="append", default=None,
                   help="ReDrafter artifact dir or hub id (repeat for several)")
    m.add_argument("--ngrams", action="append", default=None,
                   help="n-gram table dir or hub id (repeat for several)")
    m.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the preset's, else by device)")
    m.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: CUDA when available)")
    m.add_argument("--acceptance", default=None, choices=["greedy", "rejection", "typical"],
                   help="acceptance rule (default: the preset's, except that 'greedy' or none becomes 'rejection': "
                        "lossless sampling for requests with temperature > 0, and temperature-0 requests are "
                        "still exactly greedy)")
    m.add_argument("--prefill-chunk", default=None,
                   help="prompt tokens prefilled per step beside the running requests: 'auto' (from the measured "
                        "cost curve), a number, or 0 (every prompt in one forward); default: the preset's, else auto")
    m.add_argument("--speculation", action=argparse.BooleanOptionalAction, default=True,
                   help="speculative decoding; --no-speculation serves plain autoregressive decoding "
                        "with the same loop (the baseline of the load benchmark)")
    m.add_argument("--served-model-name", default=None,
                   help="model id in /v1/models and in requests (default: the target spec)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port, printed at start)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1; unset: $REDRAFT_API_KEY if set (keeps the "
                        "key out of the process list), else no key")
    s.add_argument("--max-batch", type=int, default=16, help="requests decoding at once (rows of one batch)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a row; more get 429 with Retry-After")
    s.add_argument("--default-max-tokens", type=int, default=256,
                   help="new tokens for a request that sets no max_tokens (capped by the context)")
    s.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body accepted; larger ones get 413 before they are read")
    s.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="let browsers on ORIGIN call the API (CORS, preflight included; repeat for several, "
                        "'*' for any); unset: no CORS headers")
    s.add_argument("--grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    s.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run a short generation before accepting requests")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    return p


def check_args(args, parser) -> None:
    """Argument checks that need nothing loaded (before the minute a model can take)."""
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port} must lie in [0, 65535]")
    if args.max_batch < 1:
        parser.error(f"--max-batch {args.max_batch} must be >= 1")
    if args.max_queue < 0:
        parser.error(f"--max-queue {args.max_queue} must be >= 0")
    if args.default_max_tokens < 1:
        parser.error(f"--default-max-tokens {args.default_max_tokens} must be >= 1")
    if args.max_request_bytes < 1:
        parser.error(f"--max-request-bytes {args.max_request_bytes} must be >= 1")
    if args.grace < 0:
        parser.error(f"--grace {args.grace} must be >= 0")
    if args.api_key is not None and not args.api_key.strip():
        parser.error("--api-key is empty; give a key or leave it unset")


def load(args):
    """The decoder the flags describe: the preset (if any) with the flags' overrides."""
    from redraft.infer import load_decoder, load_preset, read_preset

    overrides = {k: v for k, v in (("target", args.target), ("drafters", args.drafter), ("ngrams", args.ngrams),
                                   ("dtype", args.dtype), ("device", args.device)) if v is not None}
    acceptance = args.acceptance
    if acceptance is None:
        # a server takes requests of any temperature: a greedy decoder is served with lossless
        # rejection sampling instead (a temperature-0 row still takes the argmax: same output)
        preset = read_preset(args.preset).get("acceptance") if args.preset else None
        acceptance = "rejection" if preset in (None, "greedy") else preset
    overrides["acceptance"] = acceptance
    if args.prefill_chunk is not None:
        overrides["prefill_chunk"] = args.prefill_chunk
    if not args.speculation:  # plain decoding: no artifacts, no context matcher, no tree
        overrides.update(drafters=[], ngrams=[], context=False, budget=0)
    if args.preset:
        return load_preset(args.preset, **overrides)
    return load_decoder(**{"target": "default", **overrides})


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("REDRAFT_API_KEY") or None
    check_args(args, parser)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from redraft.errors import RedraftError

    try:
        from redraft.serve.server import bind, run

        try:
            sock = bind(args.host, args.port)
        except OSError as exc:
            print(f"redraft-serve: cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); "
                  f"choose another --port or stop what holds it.", file=sys.stderr)
            return 2
        from redraft.serve.app import create_app

        decoder = load(args)
        name = args.served_model_name or str(getattr(decoder.target, "spec", "") or "default")
        app = create_app(decoder, name, api_key=args.api_key, max_batch=args.max_batch, max_queue=args.max_queue,
                         default_max_tokens=args.default_max_tokens, warmup=args.warmup,
                         max_request_bytes=args.max_request_bytes, cors_origins=args.cors_origin or ())
        host, port = sock.getsockname()[:2]
        print(f"redraft-serve: serving {name!r} on http://{host if ':' not in host else f'[{host}]'}:{port}/v1 "
              f"(max batch {args.max_batch}, queue {args.max_queue})", flush=True)
        try:
            run(app, sock, grace_s=args.grace, log_level=args.log_level)
        except SystemExit as exc:  # uvicorn exits when the app's start-up (the decode loop) fails
            failure = app.state.scheduler.failure
            print(f"redraft-serve: the decoder failed to start: {failure!r}" if failure else
                  f"redraft-serve: the server stopped (exit {exc.code}).", file=sys.stderr)
            return 2
    except RedraftError as exc:
        print(f"redraft-serve: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
