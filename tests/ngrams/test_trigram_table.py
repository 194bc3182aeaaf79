"""THE tri-gram table type: construction, the one lookup (numpy and torch, padded rows and CSR
gather) against a brute-force reference, point probabilities, validation, adapters."""

import collections

import numpy as np
import pytest
import torch

from redraft.errors import ArtifactError, ConfigError
from redraft.ngrams import (
    NGramTables,
    TrigramTable,
    as_trigram_table,
    build_trigram_table,
    count_trigrams,
    save_tables,
    trigram_table_from_token_arrays,
    trigram_table_from_trigrams,
)

V = 30


def _records(seed=0, n=60, vocab=V, max_len=25):
    rng = np.random.default_rng(seed)
    # skewed ids: contexts repeat and have several successors, some with equal counts
    return [
        np.minimum(rng.geometric(0.2, size=int(rng.integers(0, max_len))) - 1, vocab - 1)
        for _ in range(n)
    ]


def _reference(records, t, min_count=1):
    """{(w1, w2): [(w3, prob)]} by plain Python: count, divide by the context total, sort by
    count descending then id, keep t with count >= min_count."""
    tri = collections.Counter()
    for r in records:
        for i in range(len(r) - 2):
            tri[(int(r[i]), int(r[i + 1]), int(r[i + 2]))] += 1
    total = collections.Counter()
    for (a, b, _), n in tri.items():
        total[(a, b)] += n
    out = {}
    for (a, b), tot in total.items():
        succ = sorted(
            (-n, c) for (x, y, c), n in tri.items() if (x, y) == (a, b) and n >= min_count
        )[:t]
        if succ:
            out[(a, b)] = [(c, -n / tot) for n, c in succ]
    return out


def _expected(ref, w1, w2, k):
    ids = np.full((len(w1), k), -1)
    probs = np.zeros((len(w1), k))
    for i, (a, b) in enumerate(zip(w1, w2)):
        for j, (c, p) in enumerate(ref.get((int(a), int(b)), [])[:k]):
            ids[i, j], probs[i, j] = c, p
    return ids, probs


def test_worked_example_of_the_module_doc():
    t = trigram_table_from_trigrams(
        [1, 1, 1, 2], [2, 2, 2, 3], [5, 6, 7, 9], [1, 3, 2, 4], vocab_size=10
    )
    assert t.context_keys.tolist() == [12, 23] and t.offsets.tolist() == [0, 3, 4]
    assert t.ids.tolist() == [6, 7, 5, 9] and t.context_counts.tolist() == [6, 4]
    ids, probs = t.successors(np.array([1, 2, 4]), np.array([2, 3, 4]), 2)
    assert ids.dtype == np.int64 and probs.dtype == np.float32
    assert ids.tolist() == [[6, 7], [9, -1], [-1, -1]]
    np.testing.assert_allclose(probs, [[3 / 6, 2 / 6], [1, 0], [0, 0]], rtol=1e-6)
    p = t.prob(np.array([1, 1, 3, 2]), np.array([2, 2, 3, 3]), np.array([5, 8, 1, 9]))
    np.testing.assert_allclose(p, [1 / 6, 0, 0, 1], rtol=1e-6)


def test_from_trigrams_sums_repeats_and_prunes_like_the_builder():
    # (1, 2, 5) given twice: counts add up; t=1 keeps the most frequent, min_count drops rare ones
    t = trigram_table_from_trigrams(
        [1, 1, 1, 3], [2, 2, 2, 4], [5, 6, 5, 7], [2, 3, 2, 1], vocab_size=10, t=1, min_count=2
    )
    assert t.context_keys.tolist() == [12] and t.ids.tolist() == [5]
    np.testing.assert_allclose(t.probs, [4 / 7])
    assert (t.t, t.min_count) == (1, 2)
    assert len(trigram_table_from_trigrams([], [], [], [], vocab_size=10)) == 0


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("dense", [True, False], ids=["padded-rows", "csr-gather"])
def test_successors_equal_brute_force_reference(backend, dense, monkeypatch):
    if not dense:
        monkeypatch.setattr(TrigramTable, "DENSE_MAX_BYTES", 0)
    records = _records()
    ref = _reference(records, t=4)
    table = trigram_table_from_token_arrays(records, V, t=4)
    assert (table._dense_rows() is not None) == dense
    rng = np.random.default_rng(1)
    seen = np.array(list(ref))  # [n, 2] contexts that occur
    w1 = np.concatenate([seen[:, 0], rng.integers(0, V, 40), [-1, 3, V, 2 * V, -5]])
    w2 = np.concatenate([seen[:, 1], rng.integers(0, V, 40), [3, -1, 0, 1, 7]])
    for k in (1, 3, 4, 7):  # fewer, as many and more columns than the table keeps
        want_ids, want_probs = _expected(ref, w1, w2, k)
        if backend == "torch":
            ids, probs = table.successors(torch.from_numpy(w1), torch.from_numpy(w2), k)
            assert ids.dtype == torch.long and probs.dtype == torch.float32
            ids, probs = ids.numpy(), probs.numpy()
        else:
            ids, probs = table.successors(w1, w2, k)
        assert ids.shape == (len(w1), k)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(probs, want_probs, rtol=1e-6)


def test_out_of_vocabulary_ids_never_alias_another_context():
    table = trigram_table_from_trigrams([1, 2], [V - 1, 0], [5, 6], [1, 1], vocab_size=V)
    # (1, V + V - 1) and (2, -V... ) pack to a stored key's value but are not that context
    ids, _ = table.successors(np.array([1, 2, 0, 3]), np.array([V - 1, 0, 2 * V - 1, -V]), 1)
    assert ids[:, 0].tolist() == [5, 6, -1, -1]
    ids, _ = table.successors(torch.tensor([0, 3]), torch.tensor([2 * V - 1, -V]), 1)
    assert ids[:, 0].tolist() == [-1, -1]


def test_lookups_return_fresh_arrays_and_the_table_is_read_only():
    table = trigram_table_from_token_arrays(_records(), V, t=4)
    w1, w2 = table.context_keys[:5] // V, table.context_keys[:5] % V
    ids, probs = table.successors(w1, w2, 4)
    ids[:] = 0  # ADED's overlay writes its boosts into the rows it gets back
    probs[:] = 1
    again, p2 = table.successors(w1, w2, 4)
    assert (again[:, 0] != 0).any() and (p2 < 1).all()
    with pytest.raises(ValueError):
        table.ids[0] = 1
    with pytest.raises(ValueError):
        table.probs[0] = 0.5


def test_prob_is_the_probability_of_each_listed_successor():
    table = trigram_table_from_token_arrays(_records(seed=2), V, t=3)
    C = len(table)
    row = np.repeat(np.arange(C), np.diff(table.offsets))  # context of each entry
    keys = table.context_keys[row]
    p = table.prob(keys // V, keys % V, table.ids)
    np.testing.assert_array_equal(p, table.probs)
    tp = table.prob(
        torch.from_numpy(keys // V),
        torch.from_numpy(keys % V),
        torch.from_numpy(np.array(table.ids)),
    )
    np.testing.assert_array_equal(tp.numpy(), table.probs)
    assert table.prob(np.array([0, -1]), np.array([V + 3, 2]), np.array([1, 1])).tolist() == [0, 0]


def test_builders_agree():
    records = _records(seed=3)
    a = trigram_table_from_token_arrays(records, V, t=5, min_count=2)
    b = build_trigram_table(count_trigrams(records, V, chunk_tokens=40), t=5, min_count=2)
    tri = collections.Counter(
        (int(r[i]), int(r[i + 1]), int(r[i + 2])) for r in records for i in range(len(r) - 2)
    )
    w1, w2, w3 = (np.array([k[j] for k in tri]) for j in range(3))
    c = trigram_table_from_trigrams(w1, w2, w3, np.array(list(tri.values())), V, t=5, min_count=2)
    d = TrigramTable.from_csr(a.context_keys, a.offsets, a.ids, a.probs, V, t=5)
    for other in (b, c, d):
        for name in ("context_keys", "offsets", "ids", "probs"):
            np.testing.assert_array_equal(getattr(a, name), getattr(other, name), err_msg=name)
    assert a.stats["tokens"] == sum(len(r) for r in records)


def test_from_csr_sorts_each_row_by_probability():
    keys, offsets = [3, 7], [0, 3, 5]
    ids, probs = [4, 5, 6, 1, 2], [0.1, 0.5, 0.2, 0.3, 0.3]
    t = TrigramTable.from_csr(keys, offsets, ids, probs, vocab_size=10)
    assert t.ids.tolist() == [5, 6, 4, 1, 2]  # equal probabilities keep their order
    np.testing.assert_allclose(t.probs, [0.5, 0.2, 0.1, 0.3, 0.3])
    u = TrigramTable.from_csr(
        torch.tensor(keys),
        torch.tensor(offsets),
        torch.tensor(ids),
        torch.tensor(probs),
        vocab_size=10,
    )
    assert u.ids.tolist() == t.ids.tolist() and (u.t, u.max_successors) == (3, 3)


@pytest.mark.parametrize(
    "arrays,message",
    [
        (([1, 2], [0, 1], [3], [0.5]), "2 contexts"),
        (([1, 2], [0, 1, 2], [3, 4], [0.5]), "2 ids but 1 probs"),
        (([2, 1], [0, 1, 2], [3, 4], [0.5, 0.5]), "not strictly increasing"),
        (([1, 1], [0, 1, 2], [3, 4], [0.5, 0.5]), "not strictly increasing"),
        (([1, 2], [0, 2, 1], [3, 4], [0.5, 0.5]), "to 1, want 0 to 2"),
        (([1, 2], [0, 1, 2], [3, 10], [0.5, 0.5]), r"ids outside \[0, 10\)"),
        (([1, 100], [0, 1, 2], [3, 4], [0.5, 0.5]), "context keys outside"),
        (([1, 2], [0, 1, 2], [3, 4], [0.5, float("nan")]), "NaN"),
        (([1, 2], [0, 1, 2], [3, 4], [0.5, 1.5]), r"outside \[0, 1\]"),
    ],
)
def test_inconsistent_arrays_are_named(arrays, message):
    with pytest.raises(ArtifactError, match=message):
        TrigramTable.from_csr(*arrays, vocab_size=10)


def test_empty_table_misses_everything():
    t = TrigramTable.empty(10)
    ids, probs = t.successors(np.array([1, 2]), np.array([3, 4]), 3)
    assert ids.tolist() == [[-1] * 3] * 2 and probs.sum() == 0
    assert t.successors(torch.tensor([1]), torch.tensor([3]), 2)[0].tolist() == [[-1, -1]]


def test_k_must_be_positive():
    t = trigram_table_from_trigrams([1], [2], [3], [1], vocab_size=10)
    with pytest.raises(ConfigError, match="k=0") as err:
        t.successors(np.array([1]), np.array([2]), 0)
    assert err.value.param == "k"


def test_ngram_tables_hand_out_the_table(tmp_path):
    table = trigram_table_from_token_arrays(_records(seed=4), V, t=4)
    save_tables(tmp_path, {"vocab_size": V, "tokenizer_fingerprint": "sha256:x"}, trigram=table)
    loaded = NGramTables.load(tmp_path)
    assert as_trigram_table(loaded) is loaded.trigram and as_trigram_table(table) is table
    assert loaded.t == 4 and loaded.trigram.min_count == 1
    w1, w2 = (
        torch.tensor([int(table.context_keys[0] // V), 0]),
        torch.tensor([int(table.context_keys[0] % V), 29]),
    )
    a_ids, a_p = loaded.trigram_successors(w1, w2)
    b_ids, b_p = table.successors(w1.numpy(), w2.numpy(), 4)
    assert a_ids.tolist() == b_ids.tolist()
    np.testing.assert_allclose(a_p.numpy(), b_p, atol=1e-3)  # float16 on disk
    save_tables(
        tmp_path / "b",
        {"vocab_size": V, "tokenizer_fingerprint": "sha256:x"},
        unigram=(torch.tensor([1, 2]), torch.tensor([0.5, 0.25])),
    )
    with pytest.raises(ArtifactError, match="no trigram table.*--kinds trigram"):
        as_trigram_table(NGramTables.load(tmp_path / "b"))
    with pytest.raises(ConfigError, match="dict"):
        as_trigram_table({"keys": []})
