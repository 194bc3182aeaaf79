"""Tri-gram counting, pruning, spilling and shard merging against a plain Python reference."""

import collections
import itertools

import numpy as np
import pytest

from redraft.errors import ArtifactError, DataError
from redraft.ngrams.trigrams import (
    build_trigram_table,
    count_trigrams,
    load_counts,
    packable,
    split_keys,
)


def _corpus(seed=0, vocab=40, records=200, max_len=30):
    rng = np.random.default_rng(seed)
    # Skewed ids (a few frequent tokens) so contexts have several successors and count ties.
    return [
        np.minimum(rng.geometric(0.15, size=int(rng.integers(0, max_len))) - 1, vocab - 1).astype(
            np.int32
        )
        for _ in range(records)
    ]


def _reference(records):
    tri = collections.Counter()
    for r in records:
        for i in range(len(r) - 2):
            tri[(int(r[i]), int(r[i + 1]), int(r[i + 2]))] += 1
    return tri


def _as_dict(counts, V):
    out = {}
    for keys, n in counts.iter_ranges():
        ctx, w3 = split_keys(keys, V)
        for c, w, k in zip(ctx.tolist(), w3.tolist(), n.tolist()):
            assert (c // V, c % V, w) not in out, "a key appears in two ranges"
            out[(c // V, c % V, w)] = k
    return out


@pytest.mark.parametrize(
    "chunk_tokens,memory_mb",
    [(1 << 20, 4096), (97, 4096), (97, 0)],
    ids=["one-chunk", "many-chunks", "spill-every-chunk"],
)
def test_counts_equal_python_counter(chunk_tokens, memory_mb, tmp_path):
    records = _corpus()
    counts = count_trigrams(
        records, 40, chunk_tokens=chunk_tokens, memory_mb=memory_mb, spill_dir=tmp_path / "spill"
    )
    ref = _reference(records)
    assert _as_dict(counts, 40) == dict(ref)
    assert counts.stats == {
        "records": 200,
        "tokens": sum(map(len, records)),
        "trigrams": sum(ref.values()),
    }
    if memory_mb == 0:
        assert len(counts.spilled) > 1


def test_vocab_too_large_for_packing_uses_wide_keys():
    assert packable(2_097_151) and not packable(2_097_152)
    V = 3_000_000
    rng = np.random.default_rng(1)
    hi = V - 1 - rng.integers(0, 3, size=(50, 12))  # ids near V: packing would overflow int64
    records = [r.astype(np.int64) for r in np.concatenate([hi, rng.integers(0, 3, size=(50, 12))])]
    counts = count_trigrams(records, V, chunk_tokens=200)
    assert _as_dict(counts, V) == dict(_reference(records))


def test_trigrams_never_span_records():
    counts = count_trigrams(
        [np.array([1, 2]), np.array([3, 4]), np.array([5]), np.array([], np.int32)], 10
    )
    assert counts.stats["trigrams"] == 0
    with pytest.raises(DataError, match="no tri-gram"):
        build_trigram_table(counts)


def test_token_outside_vocab_names_the_record():
    with pytest.raises(DataError, match="record 2 holds token id 12"):
        count_trigrams([np.array([1, 2, 3]), np.array([4, 5]), np.array([1, 12, 3])], 10)


def test_table_probabilities_top_t_and_ties_equal_reference():
    records = _corpus(seed=3)
    ref = _reference(records)
    t, min_count = 3, 2
    table = build_trigram_table(
        count_trigrams(records, 40, chunk_tokens=50), t=t, min_count=min_count
    )
    ctx_total = collections.Counter()
    for (a, b, _), n in ref.items():
        ctx_total[(a, b)] += n
    expected = {}
    for (a, b), total in ctx_total.items():
        succ = sorted(
            ((-n, c) for (x, y, c), n in ref.items() if (x, y) == (a, b) and n >= min_count)
        )[:t]
        if succ:
            expected[a * 40 + b] = ([c for _, c in succ], [-n / total for n, _ in succ], total)
    assert table.context_keys.tolist() == sorted(expected)
    for i, key in enumerate(table.context_keys.tolist()):
        lo, hi = table.offsets[i], table.offsets[i + 1]
        ids, probs, total = expected[key]
        assert table.ids[lo:hi].tolist() == ids
        np.testing.assert_allclose(table.probs[lo:hi], probs, rtol=1e-6)
        assert table.context_counts[i] == total
    assert max(np.diff(table.offsets)) == t  # some context was pruned to t


def _table_arrays(table):
    return [table.context_keys, table.offsets, table.ids, table.probs, table.context_counts]


def test_shard_and_merge_equals_single_build(tmp_path):
    records = _corpus(seed=5, records=300)
    single = build_trigram_table(count_trigrams(records, 40), t=4, min_count=1)
    dirs = []
    for i in range(3):
        part = count_trigrams(
            itertools.islice(records, i, None, 3),
            40,
            chunk_tokens=64,
            memory_mb=0 if i == 1 else 4096,
        )  # shard 1 saves from spilled runs
        dirs.append(
            part.save(
                tmp_path / f"shard{i}",
                meta={"num_shards": 3, "shard_id": i, "tokenizer_fingerprint": "sha256:x"},
            )
        )
    merged = build_trigram_table(load_counts(dirs, memory_mb=0), t=4, min_count=1)  # many ranges
    for a, b in zip(_table_arrays(single), _table_arrays(merged)):
        np.testing.assert_array_equal(a, b)
    assert merged.stats["tokens"] == single.stats["tokens"]


def test_merge_rejects_missing_and_truncated_shards(tmp_path):
    records = _corpus(seed=6)
    dirs = [
        count_trigrams(records[i::2], 40).save(
            tmp_path / f"s{i}", meta={"num_shards": 2, "shard_id": i}
        )
        for i in range(2)
    ]
    with pytest.raises(ArtifactError, match=r"missing \[1\]"):
        load_counts(dirs[:1])
    keys = dirs[1] / "keys.bin"
    keys.write_bytes(keys.read_bytes()[:-8])
    with pytest.raises(ArtifactError, match="truncated"):
        load_counts(dirs)
