"""The OpenAI-compatible server over the speculative decoder, with continuous batching.

    from redraft.serve import create_app
    app = create_app(decoder, model_name="default")     # a FastAPI app; redraft-serve runs it

``app`` (endpoints, errors, auth), ``scheduler`` (the decode loop thread: rows join and leave
between steps), ``protocol`` (OpenAI request/response schema), ``metrics`` (Prometheus),
``server`` (uvicorn with a SIGTERM drain), ``cli`` (``redraft-serve``). The load benchmark is
:mod:`redraft.bench.loadtest`. See docs/serve.md.
"""


def create_app(*args, **kwargs):
    """:func:`redraft.serve.app.create_app` (imported on first use: FastAPI loads only when serving)."""
    from redraft.serve.app import create_app as _create_app

    return _create_app(*args, **kwargs)


__all__ = ["create_app"]
