"""N-gram draft tables: model-derived unigram/bigram/extended (N-Grammys) and corpus tri-grams (ADED).

Build them with ``redraft-build-ngrams`` (:mod:`redraft.ngrams.cli`) or the functions below; load
them for decoding with :meth:`NGramTables.load` and look up drafts in batches::

    from redraft.ngrams import NGramTables, trigram_table_from_token_arrays
    tables = NGramTables.load("checkpoints/ngrams-smollm2", target=target)
    ids, probs = tables.bigram_topk(torch.tensor([42, 7]))          # [2, k], [2, k]
    chains = tables.extended(torch.tensor([42]))                     # [1, k, w]
    tri = tables.trigram                                             # THE tri-gram table type
    ids, probs = tri.successors(w1, w2, k=12)                        # numpy or torch; -1 / 0 where absent
    tri = trigram_table_from_token_arrays(token_arrays, vocab_size)  # in memory, same counter

docs/ngrams.md is the guide (formats, CLI, figures).

The names below are imported on first use, so that ``import redraft.ngrams.cli`` (and therefore
``redraft-build-ngrams --help``) does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "KINDS": "redraft.ngrams.format",
    "NGramTables": "redraft.ngrams.tables",
    "save_tables": "redraft.ngrams.tables",
    "TrigramTable": "redraft.ngrams.trigram_table",
    "as_trigram_table": "redraft.ngrams.tables",
    "TrigramCounter": "redraft.ngrams.trigram_counts",
    "TrigramCounts": "redraft.ngrams.trigram_counts",
    "build_trigram_table": "redraft.ngrams.trigrams",
    "count_trigrams": "redraft.ngrams.trigram_counts",
    "load_counts": "redraft.ngrams.trigram_counts",
    "merge_counts": "redraft.ngrams.trigram_counts",
    "packable": "redraft.ngrams.trigrams",
    "trigram_table_from_token_arrays": "redraft.ngrams.trigrams",
    "trigram_table_from_trigrams": "redraft.ngrams.trigrams",
    "bigram_context": "redraft.ngrams.model_tables",
    "build_bigram": "redraft.ngrams.model_tables",
    "build_extended": "redraft.ngrams.model_tables",
    "build_extended_with_model": "redraft.ngrams.model_tables",
    "build_unigram": "redraft.ngrams.model_tables",
    "unigram_probs": "redraft.ngrams.model_tables",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'redraft.ngrams' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
