"""Build a :class:`SpeculativeDecoder` from a target spec and artifact directories.

    from redraft.infer import load_decoder
    dec = load_decoder("default", drafters=["checkpoints/redrafter-smollm2"],
                       ngrams=["checkpoints/ngrams-smollm2"])
    print(dec.generate([{"role": "user", "content": "Hi!"}])[0].text)

Artifacts are local directories or hub ids ``REPO_ID[@rev]`` (``redraft.hub.resolve_artifact``);
each is checked against the target's tokenizer fingerprint when loaded. Every decoder setting
is a :class:`~redraft.infer.config.DecoderConfig` field.
"""

from __future__ import annotations

import logging
from pathlib import Path

from redraft.errors import ConfigError
from redraft.infer.config import FIELDS, DecoderConfig
from redraft.infer.decoder import SpeculativeDecoder
from redraft.infer.drafters.ngram import ContextNGramDrafter, NGrammysDrafter, TableDrafter
from redraft.infer.drafters.redrafter.drafter import ReDrafterDrafter
from redraft.settings import read_yaml_mapping, split_keys

logger = logging.getLogger(__name__)

LOAD_KEYS = ("target", "drafters", "ngrams", "dtype", "device")  # load_decoder's own arguments


def load_redrafter(
    path,
    target,
    width=FIELDS["redrafter_width"].default,
    length=FIELDS["redrafter_length"].default,
    name: str = "redrafter",
):
    """A :class:`ReDrafterDrafter` from a drafter artifact (``width`` and ``length``: numbers or
    "auto", the defaults; ``length=None``: the head's training horizon ``num_steps``)."""
    from redraft.models.drafter_io import load_drafter

    return ReDrafterDrafter(load_drafter(path, target), width=width, length=length, name=name)


def load_ngram_tables(path, target):
    """``redraft.ngrams.NGramTables`` for ``target`` (fingerprint checked), on its device."""
    from redraft.ngrams import NGramTables

    return NGramTables.load(path, target=target, device=target.device)


def ngram_drafters(tables, target, cfg: DecoderConfig, name_prefix: str = "") -> list:
    """The N-Grammys drafters the tables allow: the mixed strategy (context matches, then extended
    bigram rows) when extended chains exist, else bigram rows plus context matches. Context
    rows come from matches of ``context_q_max`` down to ``context_q`` tokens, longest first,
    ``ngram_w`` tokens each."""
    kinds = set(getattr(tables, "kinds", ["extended"]))
    V = target.vocab_size
    k, w, q, q_max = cfg.ngram_k, cfg.ngram_w, cfg.context_q, cfg.context_q_max
    if "extended" in kinds:
        return [
            NGrammysDrafter(tables, V, k=k, w=w, q=q, q_max=q_max, name=f"{name_prefix}ngrammys")
        ]
    out = [ContextNGramDrafter(V, q=q, q_max=q_max, k=k, w=w, name=f"{name_prefix}context")]
    if "bigram" in kinds:
        out.append(TableDrafter(tables, "bigram", k=k, name=f"{name_prefix}bigram"))
    return out


def suffix_drafter(cfg: DecoderConfig):
    """The suffix-tree drafter of ``cfg`` (``ngram_k`` paths of up to ``suffix_w`` tokens)."""
    from redraft.infer.drafters.suffix import SuffixDrafter

    return SuffixDrafter(
        max_paths=cfg.ngram_k,
        max_tokens_per_path=cfg.suffix_w,
        max_spec_factor=cfg.suffix_factor,
        max_tokens=cfg.suffix_tokens,
    )


def make_drafters(target, heads=(), tables=(), cfg: DecoderConfig | None = None) -> list:
    """The unified mix over loaded artifacts: every ReDrafter head (``heads``: drafters from
    :func:`load_redrafter`), the N-Grammys drafters of every n-gram table set (``tables``), ADED
    over table sets with tri-grams when ``cfg.aded``, the suffix trees when ``cfg.suffix``, and a
    context matcher when ``cfg.context``
    (default: only when there are no tables, which already include context matches).
    ``load_decoder`` and ``redraft-bench``'s ``mix`` both build their drafters here."""
    cfg = cfg or DecoderConfig()
    ds = list(heads)
    for i, tables_i in enumerate(tables):
        prefix = "" if len(tables) == 1 else f"t{i}-"
        ds += ngram_drafters(tables_i, target, cfg, name_prefix=prefix)
        if cfg.aded and "trigram" in getattr(tables_i, "kinds", ()):
            from redraft.infer.drafters.aded.drafter import ADEDDrafter

            d = ADEDDrafter(tables_i)
            d.name = f"{prefix}aded"
            ds.append(d)
    if cfg.suffix:
        ds.append(suffix_drafter(cfg))
    if cfg.context if cfg.context is not None else not tables:
        ds.append(
            ContextNGramDrafter(
                target.vocab_size,
                q=cfg.context_q,
                q_max=cfg.context_q_max,
                k=cfg.ngram_k,
                w=cfg.ngram_w,
            )
        )
    return ds


def _artifact_list(value, key: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (str, Path)):
        raise ConfigError(
            f"{key}={str(value)!r}: pass a list of artifact paths or hub ids, e.g. "
            f"{key}=[{str(value)!r}].",
            param=key,
        )
    if not all(isinstance(v, (str, Path)) for v in value):
        raise ConfigError(f"{key}: every entry must be a path or hub id string.", param=key)
    return [str(v) for v in value]


def load_decoder(
    target="default",
    drafters=(),
    ngrams=(),
    *,
    config: DecoderConfig | None = None,
    dtype=None,
    device=None,
    **settings,
) -> SpeculativeDecoder:
    """The unified decoder over every given artifact.

    Args:
        target: a target spec for ``load_target`` ("default", hub id, path) or a loaded Target.
        drafters: ReDrafter artifact directories / hub ids (one drafter each).
        ngrams: n-gram table directories / hub ids (``redraft-build-ngrams`` outputs).
        config: a :class:`DecoderConfig`; ``**settings`` (its field names: ``budget``,
            ``acceptance``, ``ngram_w``, ``aded``, ...) override it. Unknown names are errors.
        dtype, device: for ``load_target`` when ``target`` is a spec.
    """
    cfg = (
        (config or DecoderConfig()).replace(**settings) if settings else (config or DecoderConfig())
    )
    drafters, ngrams = _artifact_list(drafters, "drafters"), _artifact_list(ngrams, "ngrams")
    if isinstance(target, (str, Path)):
        from redraft.models import load_target

        target = load_target(str(target), dtype=dtype, device=device)
    heads = [
        load_redrafter(
            path,
            target,
            cfg.redrafter_width,
            cfg.redrafter_length,
            name="redrafter" if len(drafters) == 1 else f"redrafter{i}",
        )
        for i, path in enumerate(drafters)
    ]
    tables = [load_ngram_tables(path, target) for path in ngrams]
    return SpeculativeDecoder(target, make_drafters(target, heads, tables, cfg), cfg)


def read_preset(path) -> dict:
    """A decoding preset (``infer/decode-*.yaml``) as a dict: ``load_decoder``'s own arguments
    (target, drafters, ngrams, dtype, device) and :class:`DecoderConfig` fields, checked."""
    from redraft.resources import find_config

    p = find_config(path, "infer")  # a file, or a shipped preset such as decode-default
    cfg = read_yaml_mapping(p, what="decoding preset")
    (decoder,) = split_keys(cfg, [DecoderConfig], str(p), ignore=LOAD_KEYS)
    DecoderConfig.from_dict(decoder, where=str(p))
    return cfg


def load_preset(path, **overrides) -> SpeculativeDecoder:
    """:func:`load_decoder` with the arguments of a YAML preset; keyword ``overrides`` win.
    Relative artifact paths the preset names that do not exist are skipped with a warning (build
    them first with redraft-train / redraft-build-ngrams)."""
    cfg = {**read_preset(path), **overrides}
    for key in ("drafters", "ngrams"):
        present = []
        for a in _artifact_list(cfg.get(key), key):
            if Path(a).exists() or not a.startswith(("checkpoints", ".", "/")):
                present.append(a)
            else:
                logger.warning("%s: %s %s not found; skipped", path, key[:-1], a)
        cfg[key] = present
    return load_decoder(**cfg)
