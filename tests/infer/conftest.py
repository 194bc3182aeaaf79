"""Fixtures for the decoder tests: tiny stand-in n-gram tables and a random ReDrafter head."""

import pytest
import torch


class TinyTables:
    """Stand-in for ``redraft.ngrams.NGramTables`` built from a model's own next-token
    distributions after single tokens (the "model bigram"), with greedy extended chains."""

    def __init__(self, model, vocab_size: int, k: int = 8, w: int = 4):
        with torch.no_grad():
            p = model(torch.arange(vocab_size)[:, None]).logits[:, -1].float().softmax(-1)  # [V, V]
        self.p = p
        top = p.topk(k, dim=-1)
        self.ids, self.probs = top.indices, top.values
        chains = [self.ids]
        for _ in range(w - 1):
            chains.append(p[chains[-1]].argmax(-1))
        self.ext = torch.stack(chains, dim=-1)  # [V, k, w]

    kinds = ("unigram", "bigram", "extended")

    def table(self, kind):
        """The stored arrays, as ``NGramTables.table`` gives them (host drafters mirror them)."""
        if kind == "unigram":
            ids, probs = self.unigram_topk(self.ids.shape[1])
            return {"ids": ids, "probs": probs}
        if kind == "bigram":
            return {"ids": self.ids, "probs": self.probs}
        return {"ids": self.ext}

    def unigram_topk(self, k):
        top = self.p.mean(0).topk(k)
        return top.indices, top.values

    def bigram_topk(self, tokens, k):
        return self.ids[tokens][:, :k], self.probs[tokens][:, :k]

    def extended(self, tokens):
        return self.ext[tokens]


@pytest.fixture(scope="session")
def tiny_tables(tiny_target):
    return TinyTables(tiny_target.model, tiny_target.vocab_size)


@pytest.fixture(scope="session")
def tiny_head(tiny_target):
    """A random ReDrafter head on the tiny target (its drafts are mostly wrong: good for
    exactness tests, which must hold whatever the drafter proposes)."""
    from redraft.models.redrafter import ReDrafter, ReDrafterConfig

    torch.manual_seed(0)
    head = ReDrafter(ReDrafterConfig.for_target(tiny_target, num_layers=1)).eval()
    return head.attach_target(tiny_target)


@pytest.fixture(scope="session")
def tiny_prompts():
    return [
        [{"role": "user", "content": "Hello there"}],
        "def add(a, b):\n    return a + b\n",
        "The quick brown fox jumps over the lazy dog. The quick brown",
    ]
