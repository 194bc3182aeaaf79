"""N-gram draft tables: model-derived unigram/bigram/extended (N-Grammys) and corpus tri-grams (ADED).

Build them with ``redraft-build-ngrams`` (:mod:`redraft.ngrams.cli`) or the functions below; load
them for decoding with :meth:`NGramTables.load` and look up drafts in batches::

    from redraft.ngrams import NGramTables
    tables = NGramTables.load("checkpoints/ngrams-smollm2", target=target)
    ids, probs = tables.bigram_topk(torch.tensor([42, 7]))          # [2, k], [2, k]
    chains = tables.extended(torch.tensor([42]))                     # [1, k, w]
    ids, probs = tables.trigram_successors(w1, w2)                   # [N, t], -1 / 0 where absent

docs/ngrams.md is the guide (formats, CLI, figures).
"""

from redraft.ngrams.model_tables import (
    bigram_context,
    build_bigram,
    build_extended,
    build_extended_with_model,
    build_unigram,
    unigram_probs,
)
from redraft.ngrams.tables import KINDS, NGramTables, save_tables
from redraft.ngrams.trigrams import (
    TrigramCounter,
    TrigramCounts,
    TrigramTable,
    build_trigram_table,
    count_trigrams,
    load_counts,
    merge_counts,
    packable,
)

__all__ = [
    "KINDS",
    "NGramTables",
    "TrigramCounter",
    "TrigramCounts",
    "TrigramTable",
    "bigram_context",
    "build_bigram",
    "build_extended",
    "build_extended_with_model",
    "build_trigram_table",
    "build_unigram",
    "count_trigrams",
    "load_counts",
    "merge_counts",
    "packable",
    "save_tables",
    "unigram_probs",
]
