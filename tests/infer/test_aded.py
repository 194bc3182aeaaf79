"""ADED: MCTS over a tri-gram table, adaptive per-request overlay, the drafter."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from redraft.infer.drafters.aded.drafter import ADEDDrafter, TrigramOverlay
from redraft.infer.drafters.aded.mcts import MCTSConfig, mcts_search, puct_exploration
from redraft.infer.spec.drafter import HostFeedback, HostState
from redraft.ngrams import (
    NGramTables,
    TrigramTable,
    as_trigram_table,
    build_trigram_table,
    count_trigrams,
    save_tables,
    trigram_table_from_trigrams,
)


def _state(rows):
    """The host's view of ``rows`` (token lists; the whole row is its prompt)."""
    seqs = [np.asarray(r, np.int64) for r in rows]
    return HostState(seqs, np.array([s[-1] for s in seqs]), np.array([len(s) for s in seqs]))


V = 50


def random_table(fanout: int, seed: int = 0, vocab: int = V, alpha: float = 1.0) -> TrigramTable:
    """Every context (w1, w2) over the vocab has ``fanout`` successors with distinct random probs."""
    rng = np.random.default_rng(seed)
    ctx = np.arange(vocab * vocab)
    succ = np.stack([rng.choice(vocab, fanout, replace=False) for _ in ctx])  # [C, f]
    p = rng.dirichlet(np.full(fanout, alpha), size=ctx.size) * 0.9  # mass < 1 like a pruned table
    keys = ctx
    offsets = np.arange(ctx.size + 1) * fanout
    return TrigramTable.from_csr(
        keys, offsets, succ.reshape(-1), p.reshape(-1).astype(np.float32), vocab
    )


def brute_force_scores(table: TrigramTable, w1: int, w2: int, depth: int):
    """Every depth-``depth`` path from (w1, w2) and its probability prod_i p_i."""
    out = {}

    def walk(a, b, prefix, pp):
        if len(prefix) == depth:
            out[tuple(prefix)] = pp
            return
        ids, probs = table.successors(np.array([a]), np.array([b]), 64)
        for t, p in zip(ids[0], probs[0]):
            if t < 0:
                break
            walk(b, int(t), prefix + [int(t)], pp * float(p))

    walk(w1, w2, [], 1.0)
    return out


def lookup_of(table):
    return lambda rows, w1, w2, k: table.successors(w1, w2, k)


def test_table_lookup_and_prob():
    t = trigram_table_from_trigrams(
        [1, 1, 1, 2], [2, 2, 2, 3], [5, 6, 7, 9], [1, 3, 2, 4], vocab_size=10
    )
    ids, probs = t.successors(np.array([1, 2, 4]), np.array([2, 3, 4]), 2)
    assert ids.tolist() == [[6, 7], [9, -1], [-1, -1]]
    np.testing.assert_allclose(probs, [[0.5, 2 / 6], [1.0, 0], [0, 0]], rtol=1e-6)
    np.testing.assert_allclose(
        t.prob(np.array([1, 1, 3]), np.array([2, 2, 3]), np.array([5, 8, 1])),
        [1 / 6, 0, 0],
        rtol=1e-6,
    )


def test_exploration_weight_formula():
    n = np.array([0.0, 7.0, 150.0])
    np.testing.assert_allclose(puct_exploration(n, 32, 8), 32 + np.log((n + 9) / 8))


def test_mcts_returns_the_top_paths_of_a_small_table():
    table = random_table(fanout=3, seed=1)
    ref = brute_force_scores(table, 3, 4, depth=3)  # 27 paths
    best = sorted(ref, key=ref.get, reverse=True)
    cfg = MCTSConfig(iterations=150, depth=3, candidates=5, top_k=3)
    res = mcts_search(np.array([3]), np.array([4]), lookup_of(table), cfg, np.random.default_rng(0))
    got = [tuple(p) for p in res.tokens[0].tolist()]
    assert got == best[:5]
    np.testing.assert_allclose(res.scores[0], np.log([ref[p] for p in best[:5]]), rtol=1e-5)
    # log-probs are the table's, token by token
    ids, probs = table.successors(np.array([3]), np.array([4]), 3)
    assert res.logp[0, 0, 0] == pytest.approx(
        np.log(probs[0][list(ids[0]).index(got[0][0])]), rel=1e-5
    )


@pytest.mark.parametrize("wave", [1, 50])
def test_mcts_defaults_rank_the_best_path_first(wave):
    table = random_table(fanout=12, seed=2, alpha=0.3)  # peaked, like a real corpus table
    ref = brute_force_scores(table, 7, 8, depth=4)  # 20736 paths
    best = max(ref, key=ref.get)
    res = mcts_search(
        np.array([7]),
        np.array([8]),
        lookup_of(table),
        MCTSConfig(wave=wave),
        np.random.default_rng(0),
    )
    assert res.tokens.shape == (1, 24, 4)
    got = [tuple(p) for p in res.tokens[0].tolist()]
    assert best in got  # the most probable path is among the candidates
    assert got[0][:2] == best[:2]  # and the first candidate starts like it
    assert (res.scores[0, :-1] >= res.scores[0, 1:]).all()  # ranked by score
    paths = {tuple(p) for p in res.tokens[0].tolist()}
    assert len(paths) == 24  # distinct candidates
    for p in res.tokens[0].tolist():  # every path is a table path
        assert tuple(p) in ref


def test_mcts_batch_rows_are_independent_and_unknown_contexts_give_nothing():
    table = random_table(fanout=4, seed=3)
    cfg = MCTSConfig(iterations=60, depth=3, candidates=6, top_k=4)
    solo = mcts_search(
        np.array([1]), np.array([2]), lookup_of(table), cfg, np.random.default_rng(0)
    )
    both = mcts_search(
        np.array([-1, 1]), np.array([-1, 2]), lookup_of(table), cfg, np.random.default_rng(0)
    )
    assert (both.tokens[0] == -1).all() and np.isneginf(both.scores[0]).all()
    assert both.tokens[1, 0].tolist() == solo.tokens[0, 0].tolist()


def test_overlay_raises_up_to_cap_adds_new_and_keeps_rows_apart():
    table = trigram_table_from_trigrams([1, 1], [2, 2], [5, 6], [3, 1], vocab_size=10)
    saved = [a.copy() for a in (table.context_keys, table.offsets, table.ids, table.probs)]
    ov = TrigramOverlay(table, batch_size=2, increment=0.2, cap=0.9)
    ov.update([0], [1], [2], [6])  # 0.25 -> 0.45
    ov.update([0, 0], [1, 1], [2, 2], [6, 6])  # two repeats: 0.45 -> 0.85
    ov.update([0], [1], [2], [7])  # new tri-gram: 0.2
    ids, probs = ov.successors(np.array([0, 1]), np.array([1, 1]), np.array([2, 2]), 3)
    assert ids[0].tolist() == [6, 5, 7] and ids[1].tolist() == [5, 6, -1]
    mass = 0.85 + 0.75 + 0.2
    np.testing.assert_allclose(probs[0], np.array([0.85, 0.75, 0.2]) / mass, rtol=1e-5)
    np.testing.assert_allclose(probs[1], [0.75, 0.25, 0], rtol=1e-6)  # row 1 sees the table
    ov.update([0] * 5, [1] * 5, [2] * 5, [6] * 5)
    assert ov.prob_[ov.key == ov._pack(0, 1, 2, 6)][0] == pytest.approx(0.9)  # capped
    for a, b in zip(saved, (table.context_keys, table.offsets, table.ids, table.probs)):
        np.testing.assert_array_equal(a, b)  # the shared table never changes
    ov.select_rows(np.array([0]))  # row 0 stays (as row 0), row 1 leaves
    assert ov.successors(np.array([0]), np.array([1]), np.array([2]), 3)[0][0].tolist() == [6, 5, 7]


def test_adaptive_updates_change_later_drafts_and_not_the_artifact(tmp_path):
    from safetensors.numpy import load_file, save_file

    table = random_table(fanout=3, seed=4, vocab=20)
    path = tmp_path / "trigrams.safetensors"
    save_file(
        {
            "keys": table.context_keys,
            "offsets": table.offsets,
            "ids": table.ids,
            "probs": table.probs,
        },
        str(path),
    )
    before = path.read_bytes()
    arrs = load_file(str(path))
    table = TrigramTable.from_csr(arrs["keys"], arrs["offsets"], arrs["ids"], arrs["probs"], 20)
    ids, _ = table.successors(np.array([4]), np.array([5]), 20)
    novel = int(next(t for t in range(20) if t not in ids[0]))  # (4, 5) -> novel: not in the table
    kw = dict(iterations=40, depth=3, candidates=4, top_k=3, increment=0.9, adapt_prompt=False)
    drafter, other = ADEDDrafter(table, **kw), ADEDDrafter(table, **kw)
    s0 = _state([[1, 2, 4], [1, 2, 4]])
    drafter.add_rows_host(s0, 0)
    other.add_rows_host(s0, 0)
    d0 = drafter.propose_host(s0)
    assert isinstance(d0.tokens, np.ndarray) and novel not in d0.tokens[0, :, 1].tolist()
    # row 0 accepted [5] and the target's bonus was ``novel``: tri-gram (4, 5, novel) observed
    fb = HostFeedback(
        accepted_prefix=np.zeros((2, 4), np.int64),
        acceptance=SimpleNamespace(emitted=[[5, novel], [9]]),
        verified=np.ones((2, 4), np.int64),
    )
    drafter.observe_host(s0, d0, fb)
    s1b = _state([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])  # both rows at context (4, 5)
    d1 = drafter.propose_host(s1b)
    assert d1.tokens[0, 0, 0] == novel  # row 0 learned (4, 5) -> novel (P 0.9)
    assert novel not in d1.tokens[1, :, 0].tolist()  # row 1 did not
    d_other = other.propose_host(s1b)
    assert novel not in d_other.tokens[0, :, 0].tolist()  # another drafter / request: unchanged
    assert path.read_bytes() == before


def test_prompt_trigrams_seed_the_overlay():
    table = random_table(fanout=2, seed=5, vocab=20)
    ids, _ = table.successors(np.array([7]), np.array([8]), 20)
    novel = int(next(t for t in range(20) if t not in ids[0]))
    drafter = ADEDDrafter(table, iterations=30, depth=2, candidates=3, top_k=2, increment=0.9)
    s = _state([[7, 8, novel, 1, 7, 8]])
    drafter.add_rows_host(s, 0)
    d = drafter.propose_host(s)
    assert d.tokens[0, 0, 0] == novel
    assert d.logp is not None and d.logp.shape == d.tokens.shape


def _tiny_corpus_table(tiny_target):
    """A tri-gram table of the tiny target's own greedy continuations (so drafts often hit)."""
    from redraft.infer.decoder import plain_greedy

    docs = [
        np.asarray(g.tokens)
        for g in plain_greedy(
            tiny_target, ["Hello", "def add(a, b):", "The quick"], max_new_tokens=48
        )
    ]
    return table_from_docs(docs, tiny_target.vocab_size)


def table_from_docs(docs, vocab_size, t=12):
    """The n-gram stage's tri-gram table of token documents, as ADED reads it."""
    return build_trigram_table(count_trigrams(docs, vocab_size), t=t)


def test_aded_greedy_equals_plain_greedy_alone_and_in_a_mix(tiny_target, tiny_prompts):
    from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
    from redraft.infer.drafters.ngram import ContextNGramDrafter

    table = _tiny_corpus_table(tiny_target)
    assert len(table) > 10
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=32)
    aded = ADEDDrafter(table, iterations=60)
    for drafters in ([aded], [ContextNGramDrafter(tiny_target.vocab_size), ADEDDrafter(table)]):
        out = SpeculativeDecoder(tiny_target, drafters, budget=24).generate(
            tiny_prompts, max_new_tokens=32
        )
        for r, o in zip(ref, out):
            assert o.tokens == r.tokens
    assert aded.stats.calls > 0 and len(aded.overlay) > 0  # it searched and adapted
    # the drafts are good on text the table was counted from: more than one token per call
    out = SpeculativeDecoder(tiny_target, [ADEDDrafter(table)], budget=24).generate(
        "Hello", max_new_tokens=32
    )
    assert out[0].stats.tokens_per_call > 1.5


def test_aded_reads_the_ngram_builders_artifact(tmp_path, tiny_target):
    rng = np.random.default_rng(0)
    V = tiny_target.vocab_size
    docs = [rng.integers(0, 20, size=200) for _ in range(5)]
    built = build_trigram_table(count_trigrams(docs, V), t=12)
    meta = dict(tiny_target.artifact_metadata(), vocab_size=V, trigram={"t": 12})
    save_tables(tmp_path, meta, trigram=built)
    loaded = NGramTables.load(tmp_path, tiny_target)
    table = as_trigram_table(loaded)
    # a brute-force count of the same documents: P(w3 | w1, w2) = C(w1, w2, w3) / C(w1, w2)
    counts = {}
    for d in docs:
        for a, b, c in zip(d[:-2], d[1:-1], d[2:]):
            counts.setdefault((int(a), int(b)), {}).setdefault(int(c), 0)
            counts[(int(a), int(b))][int(c)] += 1
    assert len(table) == len(counts)
    for (a, b), succ in list(counts.items())[:50]:
        ids, probs = table.successors(np.array([a]), np.array([b]), 12)
        total = sum(succ.values())
        want = sorted(succ.items(), key=lambda kv: -kv[1])[:12]
        assert sorted(int(i) for i in ids[0] if i >= 0) == sorted(i for i, _ in want)
        for i, p in zip(ids[0], probs[0]):
            if i >= 0:
                assert abs(float(p) - succ[int(i)] / total) < 1e-3  # float16 on disk
    w1, w2 = table.context_keys // V, table.context_keys % V
    a_ids, _ = table.successors(w1, w2, 12)
    ref_ids, _ = loaded.trigram_successors(torch.from_numpy(w1), torch.from_numpy(w2), 12)
    assert (a_ids == ref_ids.numpy()).all()


@pytest.mark.slow
def test_default_target_aded_is_exact_and_drafts_hit(default_target):
    """SmolLM2-135M with a tri-gram table counted from 300 ShareGPT training conversations."""
    from redraft.data import iter_token_arrays
    from redraft.infer.decoder import SpeculativeDecoder, plain_greedy

    docs = [
        np.array(a)
        for a in iter_token_arrays(
            "default-chat", default_target.tokenizer, split="train", limit=300, progress=False
        )
    ]
    table = table_from_docs(docs, default_target.vocab_size)
    prompts = [[{"role": "user", "content": "Write a short email asking for a meeting on Monday."}]]
    aded = ADEDDrafter(table)
    ref = plain_greedy(default_target, prompts, max_new_tokens=32)
    out = SpeculativeDecoder(default_target, [aded], budget=16).generate(prompts, max_new_tokens=32)
    assert out[0].tokens == ref[0].tokens
    assert out[0].stats.tokens_per_call > 1.0  # some drafts were accepted
    assert aded.stats.calls == out[0].stats.target_calls - 1
