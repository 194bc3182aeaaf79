"""``redraft-bench``'s methods: one explicit registry of what each needs and how its drafters
are built (``--list-methods`` prints it). Builders import their drafters when called, so the
registry itself is cheap to import."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from redraft.errors import ConfigError


@dataclass
class Method:
    """A benchmark method: what it needs and how to build its drafters.

    ``needs``: ``"ngrams:<kind>"`` (an n-gram table set holding that kind), ``"drafter"`` (a
    ReDrafter artifact) or ``"retrieval"`` (a draftretriever index). ``build(ctx)`` returns the
    drafters of a :class:`SpeculativeDecoder`, the string ``"hf"`` for transformers' own
    ``generate`` (``hf_kwargs`` its extra arguments), or ``"vllm"`` for a vLLM engine decoding
    the same prompt ids (:mod:`redraft.vllm.peer`; the method's name says which).
    """

    help: str
    build: Callable
    needs: tuple[str, ...] = ()
    hf_kwargs: Callable | None = None


def _ngram_table(ctx, kind):
    return next(t for t in ctx.tables if kind in t.kinds)


def _hierarchy(ctx, **kw):
    from redraft.infer.drafters.hsddw.drafter import default_hierarchy

    return default_hierarchy(ctx.target, **kw)


def _mix(ctx, cfg=None):
    from redraft.infer.loader import make_drafters

    return make_drafters(ctx.target, ctx.heads, ctx.tables, cfg or ctx.cfg)


def _auto_beams(ctx):
    """The loaded heads again, planning their beam width and length (``redraft.infer.drafters.redrafter.beamcost``)."""
    from redraft.infer.drafters.redrafter.drafter import ReDrafterDrafter

    return [ReDrafterDrafter(d.head, "auto", "auto", name=d.name) for d in ctx.heads]


def _context(ctx):
    from redraft.infer.drafters.ngram import ContextNGramDrafter

    c = ctx.cfg
    return [
        ContextNGramDrafter(
            ctx.target.vocab_size, q=c.context_q, q_max=c.context_q_max, k=c.ngram_k, w=c.ngram_w
        )
    ]


def _table(kind: str):
    def build(ctx):
        from redraft.infer.drafters.ngram import TableDrafter

        w = {"w": ctx.cfg.ngram_w} if kind == "extended" else {}
        return [TableDrafter(_ngram_table(ctx, kind), kind, k=ctx.cfg.ngram_k, **w)]

    return build


def _ngrammys(ctx):
    from redraft.infer.drafters.ngram import NGrammysDrafter

    c = ctx.cfg
    return [
        NGrammysDrafter(
            _ngram_table(ctx, "extended"),
            ctx.target.vocab_size,
            k=c.ngram_k,
            w=c.ngram_w,
            q=c.context_q,
            q_max=c.context_q_max,
        )
    ]


def _aded(ctx):
    from redraft.infer.drafters.aded.drafter import ADEDDrafter

    return [ADEDDrafter(_ngram_table(ctx, "trigram"))]


def _suffix(ctx):
    from redraft.infer.loader import suffix_drafter

    return [suffix_drafter(ctx.cfg)]


def _retrieval(ctx):
    from redraft.infer.drafters.retrieval import DraftRetrieverDrafter

    return [DraftRetrieverDrafter(ctx.retrieval_index)]


REGISTRY: dict[str, Method] = {
    "greedy": Method(
        "plain autoregressive greedy decoding, our loop and cache (the baseline)", lambda ctx: []
    ),
    "hf-greedy": Method("transformers generate, greedy", lambda ctx: "hf"),
    "hf-prompt-lookup": Method(
        "transformers prompt lookup decoding (prompt_lookup_num_tokens)",
        lambda ctx: "hf",
        hf_kwargs=lambda ctx: {"prompt_lookup_num_tokens": ctx.bench["prompt_lookup_num_tokens"]},
    ),
    "context": Method("context n-gram matches (prompt and output so far)", _context),
    "bigram": Method("model bigram rows", _table("bigram"), ("ngrams:bigram",)),
    "extended": Method("extended model-bigram chains", _table("extended"), ("ngrams:extended",)),
    "ngrammys": Method(
        "N-Grammys: context matches, then extended model-bigram chains",
        _ngrammys,
        ("ngrams:extended",),
    ),
    "redrafter": Method(
        "the ReDrafter head(s) alone (beam search)", lambda ctx: list(ctx.heads), ("drafter",)
    ),
    "redrafter-auto": Method(
        "the ReDrafter head(s) alone, beam width and length 'auto' (whatever the flags say)",
        _auto_beams,
        ("drafter",),
    ),
    "aded": Method(
        "ADED: MCTS over the corpus tri-gram table, adapted per request", _aded, ("ngrams:trigram",)
    ),
    "suffix": Method(
        "SuffixDecoding: suffix trees over the request and over earlier requests' outputs",
        _suffix,
    ),
    "hsddw": Method(
        "HSDDW: early-exit M1 -> early-exit M2 -> target, entropy self-verify",
        lambda ctx: [_hierarchy(ctx)],
    ),
    "hsddw-m1": Method(
        "HSDDW's M1 (early exit) with self-verify alone",
        lambda ctx: [_hierarchy(ctx, m2_layers=10**6)],
    ),
    "draftretriever": Method(
        "REST's suffix retriever (draftretriever) over --retrieval-index",
        _retrieval,
        ("retrieval",),
    ),
    "mix": Method("the unified mix over every given artifact (what load_decoder builds)", _mix),
    "mix+aded": Method(
        "the mix plus ADED over every table set with tri-grams",
        lambda ctx: _mix(ctx, ctx.cfg.replace(aded=True)),
        ("ngrams:trigram",),
    ),
    "mix+suffix": Method(
        "the mix plus the suffix drafter (its global tree kept over the run's prompts)",
        lambda ctx: _mix(ctx, ctx.cfg.replace(suffix=True)),
    ),
    "mix+hsddw": Method(
        "the mix plus the HSDDW early-exit hierarchy", lambda ctx: _mix(ctx) + [_hierarchy(ctx)]
    ),
    # vLLM on the same prompt token ids (needs vllm installed: make vllm-venv)
    "vllm": Method("vLLM, plain greedy", lambda ctx: "vllm", ("vllm",)),
    "vllm-ngram": Method(
        "vLLM's ngram proposer (prompt lookup, 1-4 token suffixes, --vllm-k tokens)",
        lambda ctx: "vllm",
        ("vllm",),
    ),
    "vllm-suffix": Method(
        "vLLM's suffix decoding (arctic-inference), --vllm-k tokens",
        lambda ctx: "vllm",
        ("vllm",),
    ),
    "vllm-redraft": Method(
        "vLLM with redraft's proposer (redraft.vllm.Proposer) over the first --ngrams tables",
        lambda ctx: "vllm",
        ("vllm",),
    ),
}

METHOD_NAMES = tuple(REGISTRY)


def list_methods() -> str:
    """``--list-methods``: one line per method, with what it needs."""
    return "\n".join(
        f"{name:18s} {m.help}" + (f"  [needs {', '.join(m.needs)}]" if m.needs else "")
        for name, m in REGISTRY.items()
    )


def check_methods(methods: list[str], have: dict) -> None:
    """Refuse (before any work) a method that is unknown or whose needs are missing.
    ``have``: ``{"ngrams": {kind, ...}, "drafter": bool, "retrieval": bool}``."""
    for m in methods:
        if m not in REGISTRY:
            raise ConfigError(
                f"--methods: unknown method {m!r}; available: {', '.join(METHOD_NAMES)} "
                f"(redraft-bench --list-methods says what each needs).",
                param="methods",
            )
        for need in REGISTRY[m].needs:
            kind = need.partition(":")[2]
            ok = kind in have["ngrams"] if kind else bool(have.get(need))
            if not ok:
                how = {
                    "drafter": "pass --drafter DIR (a redraft-train output)",
                    "retrieval": "pass --retrieval-index PATH (a draftretriever index)",
                    "vllm": "run in a venv with vLLM (make vllm-venv builds .venv-vllm)",
                }.get(
                    need,
                    f"pass --ngrams DIR with a {kind!r} table (redraft-build-ngrams --kinds {kind} ...)",
                )
                raise ConfigError(f"method {m!r} needs {need}: {how}.", param="methods")
