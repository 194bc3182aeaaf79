"""Helpers of the vLLM proposer's tests: a fake ``VllmConfig`` (the fields the proposer reads)
and a real n-gram artifact with random rows."""

import numpy as np


def fake_vllm_config(model_dir, k: int = 4, max_model_len: int = 256, vocab_size=None):
    """What :class:`redraft.vllm.Proposer` reads of vLLM's ``VllmConfig``."""
    from redraft.vllm.replay import vllm_config

    return vllm_config(model_dir, vocab_size, k, max_model_len)


def save_test_tables(path, target, seed: int = 0, kinds=("extended", "trigram")):
    """A real n-gram artifact for ``target``'s tokenizer (``save_tables``), its rows random:
    exactness never depends on what a drafter proposes, only loading and drafting are tested."""
    from redraft.ngrams.tables import save_tables
    from redraft.ngrams.trigrams import trigram_table_from_token_arrays

    rng = np.random.default_rng(seed)
    V = target.vocab_size
    tables = {}
    if "extended" in kinds:
        tables["extended"] = rng.integers(0, V, (V, 4, 6)).astype(np.int32)
    if "trigram" in kinds:
        seqs = [rng.integers(0, V, 64) for _ in range(20)] + [np.array([5, 6, 7, 8, 9] * 4)]
        tables["trigram"] = trigram_table_from_token_arrays(seqs, V, t=4, progress=False)
    return save_tables(path, target.artifact_metadata() | {"vocab_size": V}, **tables)
