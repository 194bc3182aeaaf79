"""Build a :class:`SpeculativeDecoder` from a target spec and artifact directories.

    from redraft.infer import load_decoder
    dec = load_decoder("default", drafters=["checkpoints/redrafter-smollm2"],
                       ngrams=["checkpoints/ngrams-smollm2"])
    print(dec.generate([{"role": "user", "content": "Hi!"}])[0].text)

Artifacts are local directories or hub ids ``REPO_ID[@rev]`` (``redraft.hub.resolve_artifact``);
each is checked against the target's tokenizer fingerprint when loaded.
"""

from __future__ import annotations

from redraft.errors import ConfigError
from redraft.infer.decoder import SpeculativeDecoder
from redraft.infer.drafters.ngram import ContextNGramDrafter, NGrammysDrafter, TableDrafter
from redraft.infer.drafters.redrafter import ReDrafterDrafter

DECODER_SETTINGS = ("acceptance", "budget", "max_nodes", "cost_curve", "fp32_logits", "typical_eps",
                    "typical_delta", "adapt", "gate", "gate_explore", "cpu_pack")


def load_redrafter(path, target, width: int = 8, length: int | None = None, name: str = "redrafter"):
    """A :class:`ReDrafterDrafter` from a drafter artifact (``length`` defaults to the head's
    training horizon ``num_steps``)."""
    from redraft.models.redrafter import load_drafter

    head = load_drafter(path, target)
    return ReDrafterDrafter(head, width=width, length=length or int(head.config.num_steps), name=name)


def load_ngram_tables(path, target):
    """``redraft.ngrams.NGramTables`` for ``target`` (fingerprint checked), on its device."""
    from redraft.ngrams import NGramTables

    return NGramTables.load(path, target=target, device=target.device)


def ngram_drafters(tables, target, k: int = 8, w: int = 12, q: int = 1, q_max: int = 3,
                   name_prefix: str = "") -> list:
    """The N-Grammys drafters the tables allow: the mixed strategy (context matches, then extended
    bigram rows) when extended chains exist, else bigram rows plus context matches. Context
    rows come from matches of ``q_max`` down to ``q`` tokens, longest first, ``w`` tokens each."""
    kinds = set(getattr(tables, "kinds", ["extended"]))
    V = target.vocab_size
    if "extended" in kinds:
        return [NGrammysDrafter(tables, V, k=k, w=w, q=q, q_max=q_max, name=f"{name_prefix}ngrammys")]
    out = [ContextNGramDrafter(V, q=q, q_max=q_max, k=k, w=w, name=f"{name_prefix}context")]
    if "bigram" in kinds:
        out.append(TableDrafter(tables, "bigram", k=k, name=f"{name_prefix}bigram"))
    return out


def make_drafters(target, heads=(), tables=(), *, context: bool | None = None, ngram_k: int = 8,
                  ngram_w: int = 12, context_q: int = 1, context_q_max: int = 3, aded: bool = False) -> list:
    """The unified mix over loaded artifacts: every ReDrafter head (``heads``: drafters from
    :func:`load_redrafter`), the N-Grammys drafters of every n-gram table (``tables``), ADED over
    tables with tri-grams when ``aded``, and a context matcher when ``context`` (default: only
    when there are no tables, which already include context matches). ``load_decoder`` and
    ``redraft-bench``'s ``mix`` both build their drafters here."""
    ds = list(heads)
    for i, tables_i in enumerate(tables):
        prefix = "" if len(tables) == 1 else f"t{i}-"
        ds += ngram_drafters(tables_i, target, ngram_k, ngram_w, context_q, context_q_max, name_prefix=prefix)
        if aded and "trigram" in getattr(tables_i, "kinds", ()):
            from redraft.infer.aded import ADEDDrafter

            d = ADEDDrafter(tables_i)
            d.name = f"{prefix}aded"
            ds.append(d)
    if context if context is not None else not tables:
        ds.append(ContextNGramDrafter(target.vocab_size, q=context_q, q_max=context_q_max, k=ngram_k, w=ngram_w))
    return ds


def load_decoder(target="default", drafters=(), ngrams=(), *, context: bool | None = None,
                 dtype=None, device=None, redrafter_width: int = 8, redrafter_length: int | None = None,
                 ngram_k: int = 8, ngram_w: int = 12, context_q: int = 1, context_q_max: int = 3,
                 aded: bool = False, **settings) -> SpeculativeDecoder:
    """The unified decoder over every given artifact.

    Args:
        target: a target spec for ``load_target`` ("default", hub id, path) or a loaded Target.
        drafters: ReDrafter artifact directories / hub ids (one drafter each).
        ngrams: n-gram table directories / hub ids (``redraft-build-ngrams`` outputs).
        context: add a prompt/output n-gram lookup drafter; default: only when no n-gram tables
            are given (N-Grammys already includes context matches).
        dtype, device: for ``load_target`` when ``target`` is a spec.
        redrafter_width, redrafter_length: ReDrafter beam search settings.
        ngram_k, ngram_w: rows per step and tokens per context row of n-gram drafts.
        context_q, context_q_max: context matches use the last ``context_q_max`` down to
            ``context_q`` tokens, longest first.
        aded: also draft with ADED's MCTS over each table that holds a tri-gram table (off by
            default: on the 2-core CPU it raised tau but lowered tokens/s of the mix, see
            docs/infer.md).
        **settings: :class:`SpeculativeDecoder` keyword arguments (acceptance, budget, ...).
    """
    unknown = sorted(set(settings) - set(DECODER_SETTINGS))
    if unknown:
        raise ConfigError(f"unknown decoder settings {unknown}; valid: {list(DECODER_SETTINGS)}.")
    if isinstance(target, str):
        from redraft.models import load_target

        target = load_target(target, dtype=dtype, device=device)
    heads = [load_redrafter(path, target, redrafter_width, redrafter_length,
                            name="redrafter" if len(drafters) == 1 else f"redrafter{i}")
             for i, path in enumerate(drafters)]
    tables = [load_ngram_tables(path, target) for path in ngrams]
    ds = make_drafters(target, heads, tables, context=context, ngram_k=ngram_k, ngram_w=ngram_w,
                       context_q=context_q, context_q_max=context_q_max, aded=aded)
    return SpeculativeDecoder(target, ds, **settings)


def load_preset(path, **overrides) -> SpeculativeDecoder:
    """:func:`load_decoder` with the arguments of a YAML preset (``infer/decode-*.yaml``);
    keyword ``overrides`` win. Artifacts the preset names that do not exist are skipped with a
    warning (build them first with redraft-train / redraft-build-ngrams)."""
    import logging
    from pathlib import Path

    import yaml

    from redraft.resources import find_config

    p = find_config(path, "infer")  # a file, or a shipped preset such as decode-default
    cfg = yaml.safe_load(p.read_text()) or {}
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p} must be a YAML mapping of load_decoder arguments.")
    cfg.update(overrides)
    for key in ("drafters", "ngrams"):
        present = []
        for a in cfg.get(key) or []:
            if Path(a).exists() or not str(a).startswith(("checkpoints", ".", "/")):
                present.append(a)
            else:
                logging.getLogger(__name__).warning("%s: %s %s not found; skipped", p, key[:-1], a)
        cfg[key] = present
    return load_decoder(**cfg)
