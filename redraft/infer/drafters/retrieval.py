"""REST's suffix retriever (``draftretriever`` on PyPI, the retriever ADED published) as a
drafter: a baseline for the learning-free drafters, built over the same token documents.

    build_retriever_index(docs, "corpus.idx", vocab_size)
    decoder = SpeculativeDecoder(target, [DraftRetrieverDrafter("corpus.idx")])
"""

from __future__ import annotations

import torch

from redraft.infer.spec.drafter import DecodeState, Draft, Drafter
from redraft.infer.spec.paths import PAD


class DraftRetrieverDrafter(Drafter):
    """REST / ADED's published retriever (``draftretriever`` on PyPI) as a drafter: the longest
    suffix of the row (``max_q`` down to ``min_q`` tokens) found in the corpus index proposes the
    continuations the index returns (``choices`` tree nodes at most, REST's default 64).

    Build the index with :func:`build_retriever_index` from the same token documents as the
    tri-gram table, so both methods see the same corpus.
    """

    name = "draftretriever"

    def __init__(
        self, index_path, choices: int = 64, max_q: int = 16, min_q: int = 2, depth: int = 8
    ):
        import draftretriever

        self.reader = draftretriever.Reader(str(index_path))
        self.choices, self.max_q, self.min_q, self.depth = choices, max_q, min_q, depth

    def propose(self, state: DecodeState) -> Draft:
        toks, lens = state.tokens.tolist(), state.lengths.tolist()
        rows = []
        for r in range(len(toks)):
            seq, found = toks[r][: lens[r]], []
            for q in range(min(self.max_q, len(seq)), self.min_q - 1, -1):
                out = self.reader.search(seq[-q:], choices=self.choices)
                if out[0]:
                    found = [[t if t >= 0 else PAD for t in path[: self.depth]] for path in out[0]]
                    break
            rows.append(found)
        P = max(1, max(len(f) for f in rows))
        L = max([len(p) for f in rows for p in f] + [1])
        out = torch.full((len(rows), P, L), PAD, dtype=torch.long)
        for r, f in enumerate(rows):
            for i, p in enumerate(f):
                out[r, i, : len(p)] = torch.tensor(p, dtype=torch.long)
        return Draft(tokens=out.to(state.device))


def build_retriever_index(docs, path, vocab_size: int) -> str:
    """Write a ``draftretriever`` index of the token documents ``docs`` to ``path``."""
    import draftretriever

    w = draftretriever.Writer(str(path), vocab_size=vocab_size)
    for d in docs:
        if len(d):
            w.add_entry([int(t) for t in d])
    w.finalize()
    return str(path)
