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
from dataclasses import dataclass

from redraft.cli import ModelSettings, one_line, run_cli
from redraft.errors import ConfigError
from redraft.infer.config import DecoderConfig
from redraft.settings import Range, Settings, setting
from redraft.utils import ArgumentParser, HelpFormatter, require_extra


@dataclass
class ServeSettings(Settings):
    """``redraft-serve``'s own settings (each a flag); the model flags are the shared
    :class:`~redraft.cli.ModelSettings` and ``--acceptance`` is :class:`DecoderConfig`'s."""

    KIND = "server setting"

    # ---- model
    preset: str | None = setting(
        None, "Decoding preset YAML (load_decoder arguments), e.g. infer/decode-default.yaml."
    )
    speculation: bool = setting(
        True,
        "Speculative decoding; --no-speculation serves plain autoregressive decoding "
        "with the same loop (the baseline of the load benchmark).",
    )
    served_model_name: str | None = setting(
        None, "Model id in /v1/models and in requests; none = the target spec.", literal=True
    )
    # ---- server
    host: str = setting("127.0.0.1", "Address to listen on.")
    port: int = setting(
        8000, "TCP port (0: any free port, printed at start).", range=Range(0, 65535)
    )
    api_key: str | None = setting(
        None,
        "Require 'Authorization: Bearer KEY' on /v1; none: $REDRAFT_API_KEY if set "
        "(keeps the key out of the process list), else no key.",
        literal=True,
    )
    max_batch: int = setting(16, "Requests decoding at once (rows of one batch).", range=Range(1))
    max_queue: int = setting(
        64, "Requests that may wait for a row; more get 429 with Retry-After.", range=Range(0)
    )
    default_max_tokens: int = setting(
        256,
        "New tokens for a request that sets no max_tokens (capped by the context).",
        range=Range(1),
    )
    max_request_bytes: int = setting(
        4 * 1024 * 1024,
        "Largest request body accepted; larger ones get 413 before they are read.",
        range=Range(1),
    )
    cors_origin: list[str] | None = setting(
        None,
        "Let browsers on ORIGIN call the API (CORS, preflight included; "
        "repeat for several, '*' for any); none: no CORS headers.",
        metavar="ORIGIN",
        repeat=True,
    )
    grace: float = setting(
        30.0, "Seconds in-flight requests get to finish after SIGTERM.", range=Range(0)
    )
    warmup: bool = setting(True, "Run a short generation before accepting requests.")
    threads: int | None = setting(
        None,
        "Torch CPU threads of the decoding (default: torch's, one per core). On a small CPU "
        "the server's event loop and the clients share the cores with them.",
        range=Range(1),
    )
    gc_freeze: bool = setting(
        True,
        "Move the objects alive after loading (the model, tokenizer, libraries: ~400k for the "
        "default target) out of Python's garbage collector before serving, so a full "
        "collection takes milliseconds instead of ~0.3 s in the middle of a decode step.",
    )
    log_level: str = setting("info", "Log level.", choices=("debug", "info", "warning", "error"))

    def check(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key is empty; give a key or leave it unset", param="api_key")


MODEL_FLAGS = ("target", "drafters", "ngrams", "dtype", "device")
# what a model flag left out means here: the preset decides
MODEL_SHOWN = {
    "target": "the preset's, else 'default'",
    "dtype": "the preset's, else by device",
    "drafters": "the preset's",
    "ngrams": "the preset's",
}
MODEL_KEYS = ("preset", "speculation", "served_model_name")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="redraft-serve",
        description="The speculative decoder behind an OpenAI-compatible HTTP API (docs/serve.md).",
        formatter_class=HelpFormatter,
    )
    m = p.add_argument_group("model (flags override the preset's keys)")
    ServeSettings.add_arguments(m, only=("preset",))
    ModelSettings.add_arguments(m, only=MODEL_FLAGS, shown=MODEL_SHOWN)
    DecoderConfig.add_arguments(
        m,
        only=(
            "acceptance",
            "prefill_chunk",
            "prefill_share",
            "fuse_prefill",
            "suffix",
            "suffix_tokens",
        ),
        shown={
            "suffix": "the preset's, else on where arctic-inference is installed: one global "
            "tree over every request the server answers",
            "suffix_tokens": "the preset's, else 1,000,000",
            "prefill_chunk": "the preset's, else 'auto'",
            "prefill_share": "the preset's, else 1.0",
            "fuse_prefill": "the preset's, else 'auto'",
            "acceptance": "the preset's, except that 'greedy' or none becomes 'rejection': lossless sampling for "
            "requests with temperature > 0, and temperature-0 requests are still exactly greedy",
        },
    )
    ServeSettings.add_arguments(m, only=("speculation", "served_model_name"))
    ServeSettings.add_arguments(p, "server", exclude=MODEL_KEYS)
    return p


def check_args(args, parser) -> None:
    """Argument checks that need nothing loaded (before the minute a model can take): every flag
    read as its setting's type and checked against its range and choices; ``args`` then holds
    the typed values (the server's defaults filled in; a model flag left out stays None)."""
    try:
        ServeSettings.from_args(args)
        DecoderConfig.from_dict(DecoderConfig.given(args), coerce=True)
        for key, value in ModelSettings.given(args).items():
            setattr(args, key, ModelSettings.coerce(key, value))
    except ConfigError as exc:
        parser.error(one_line(exc))


def load(args):
    """The decoder the flags describe: the preset (if any) with the flags' overrides."""
    from redraft.infer import load_decoder, load_preset, read_preset
    from redraft.infer.drafters.suffix import suffix_available

    overrides = {k: getattr(args, k) for k in MODEL_FLAGS if getattr(args, k) is not None}
    acceptance = args.acceptance
    if acceptance is None:
        # a server takes requests of any temperature: a greedy decoder is served with lossless
        # rejection sampling instead (a temperature-0 row still takes the argmax: same output)
        preset = read_preset(args.preset).get("acceptance") if args.preset else None
        acceptance = "rejection" if preset in (None, "greedy") else preset
    overrides["acceptance"] = acceptance
    for key in ("prefill_chunk", "prefill_share", "fuse_prefill", "suffix", "suffix_tokens"):
        if getattr(args, key, None) is not None:
            overrides[key] = DecoderConfig.coerce(key, getattr(args, key))
    if "suffix" not in overrides and "suffix" not in (
        read_preset(args.preset) if args.preset else {}
    ):
        # a server answers many requests: what it wrote for earlier ones drafts for later ones
        overrides["suffix"] = suffix_available()
    if not args.speculation:  # plain decoding: no artifacts, no context matcher, no tree
        overrides.update(drafters=[], ngrams=[], context=False, suffix=False, budget=0)
    if args.preset:
        return load_preset(args.preset, **overrides)
    return load_decoder(**{"target": "default", **overrides})


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("REDRAFT_API_KEY") or None
    check_args(args, parser)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_cli("redraft-serve", lambda: serve(args))


def freeze_heap() -> int:
    """Collect once, then freeze every object alive (``gc.freeze``, as vLLM's engine does after
    start-up): the collector never scans them again. Without it the server's full (generation
    2) collections scanned ~425k objects, 0.29-0.38 s each, and one fell inside the long-join
    window of a load test (docs/serve.md). Returns the objects frozen."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve(args) -> int:
    """Bind, load the decoder, serve until SIGTERM/SIGINT; the exit status."""
    require_extra("serve", what="redraft-serve")
    from redraft.serve.server import bind, run

    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        print(
            f"redraft-serve: cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); "
            f"choose another --port or stop what holds it.",
            file=sys.stderr,
        )
        return 2
    from redraft.serve.app import create_app
    from redraft.serve.scheduler import ComputeThread

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    # the decoder is loaded on the thread that will decode: a process's torch kernels on one
    # thread (ComputeThread's doc: decoding on another cost 1.2-1.5x a step on a small CPU)
    compute = ComputeThread()
    decoder = compute.call(load, args)
    name = args.served_model_name or str(getattr(decoder.target, "spec", "") or "default")
    app = create_app(
        decoder,
        name,
        api_key=args.api_key,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        default_max_tokens=args.default_max_tokens,
        warmup=args.warmup,
        max_request_bytes=args.max_request_bytes,
        cors_origins=args.cors_origin or (),
        compute=compute,
    )
    if args.gc_freeze:
        freeze_heap()
    host, port = sock.getsockname()[:2]
    from redraft.infer.spec import hostjit

    print(
        f"redraft-serve: serving {name!r} on http://{host if ':' not in host else f'[{host}]'}:{port}/v1 "
        f"(max batch {args.max_batch}, queue {args.max_queue}; host kernels: {hostjit.status()})",
        flush=True,
    )
    try:
        run(app, sock, grace_s=args.grace, log_level=args.log_level)
    except SystemExit as exc:  # uvicorn exits when the app's start-up (the decode loop) fails
        failure = app.state.scheduler.failure
        print(
            f"redraft-serve: the decoder failed to start: {failure!r}"
            if failure
            else f"redraft-serve: the server stopped (exit {exc.code}).",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
