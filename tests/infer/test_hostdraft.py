"""The host (numpy) drafting path equals the torch one it mirrors, field by field, bit for bit.

Every test runs twice: with the compiled kernels of ``redraft.infer.spec.hostjit`` (the default where
numba is installed) and with the numpy code they replace."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference.accept import accept_greedy
from reference.budget import AcceptanceStats, best_budget
from reference.tree import build_tree

from redraft.infer.drafters.ngram import (
    NGrammysDrafter,
    TableDrafter,
    context_matches_multi,
)
from redraft.infer.runner.cost import CostCurve
from redraft.infer.spec.drafter import DecodeState
from redraft.infer.spec.hostdraft import (
    HostTables,
    context_matches_np,
    ngrammys_np,
    table_rows_np,
    table_values_np,
)
from redraft.infer.spec.hoststats import HostStats, best_budget_np
from redraft.infer.spec.hosttree import (
    accepted_prefix_np,
    build_tree_np,
    credit_np,
    hit_np,
    step_feedback_np,
)
from redraft.infer.spec.paths import pad_paths
from redraft.ngrams import NGramTables


@pytest.fixture(scope="module", params=["jit", "numpy"], autouse=True)
def host_kernels(request):
    """The module's tests with the compiled kernels, then with the numpy code."""
    from redraft.infer.spec import hostjit

    if request.param == "jit" and not hostjit.ENABLED:
        pytest.skip("numba is not installed or REDRAFT_JIT=0")
    before = hostjit.ENABLED
    hostjit.ENABLED = request.param == "jit"
    yield request.param
    hostjit.ENABLED = before


TREE_FIELDS = ("tokens", "parent", "depth", "valid", "anc", "path_node", "num_nodes", "num_entries")


def padded(rows):
    """``(tokens [B, T] long, lengths [B] long)`` of host rows, right-padded with -1."""
    T = max([len(r) for r in rows] + [0])
    tokens = torch.full((len(rows), T), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return tokens, torch.tensor([len(r) for r in rows], dtype=torch.long)


def assert_same(torch_out, np_out):
    a = torch_out.numpy()
    assert a.dtype == np_out.dtype and a.shape == np_out.shape
    np.testing.assert_array_equal(a, np_out)


# ---------------------------------------------------------------------------- context matches

rows_st = st.lists(st.lists(st.integers(0, 5), max_size=40), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(
    rows=rows_st,
    q_min=st.integers(1, 3),
    extra=st.integers(0, 2),
    k=st.integers(1, 9),
    w=st.integers(1, 6),
    vocab=st.integers(6, 8),
    window=st.integers(2, 50),
)
def test_context_matches_equal_the_torch_ones(rows, q_min, extra, k, w, vocab, window):
    tokens, lengths = padded(rows)
    if tokens.shape[1] == 0:
        tokens = torch.full((len(rows), 1), -1, dtype=torch.long)
    want = context_matches_multi(tokens, lengths, q_min, q_min + extra, k, w, vocab, window)
    got = context_matches_np(
        [np.array(r, dtype=np.int64) for r in rows], q_min, q_min + extra, k, w, vocab, window
    )
    assert_same(want[0], got[0])
    assert_same(want[1], got[1])


def test_context_matches_of_long_repetitive_rows_and_edge_rows():
    rng = np.random.default_rng(0)
    rows = [
        rng.integers(0, 4, 1000),
        np.zeros(0, dtype=np.int64),
        np.array([3, 3]),
        rng.integers(0, 50, 700),
        np.tile(np.arange(7), 90),
    ]
    tokens, lengths = padded(rows)
    for q_min, q_max, k, window in (
        (1, 3, 8, 4096),
        (2, 2, 3, 64),
        (1, 1, 12, 4096),
        (3, 4, 5, 300),
    ):
        want = context_matches_multi(tokens, lengths, q_min, q_max, k, 12, 64, window)
        got = context_matches_np(rows, q_min, q_max, k, 12, 64, window)
        assert_same(want[0], got[0])
        assert_same(want[1], got[1])
    paths, group = got
    assert (paths[1:3] == -1).all() and (group[1:3] == 0).all()  # empty / too short: no matches


def test_context_matches_of_a_batch_with_thousands_of_candidates():
    """A long batch over a tiny vocabulary: thousands of candidate positions, so both sorts take
    the single-argsort path of ``_order``; still equal to the torch reference."""
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 3, int(n)) for n in rng.integers(1500, 3000, 6)]
    tokens, lengths = padded(rows)
    for q_min, q_max, k in ((1, 3, 8), (1, 1, 3)):
        want = context_matches_multi(tokens, lengths, q_min, q_max, k, 12, 3, 4096)
        got = context_matches_np(rows, q_min, q_max, k, 12, 3, 4096)
        assert_same(want[0], got[0])
        assert_same(want[1], got[1])


@pytest.mark.parametrize("m", [0, 5, 3000])
def test_order_is_lexsort_of_bounded_keys(m):
    from redraft.infer.spec.hostdraft import _order

    rng = np.random.default_rng(m)
    a, b = rng.integers(0, 7, m), rng.permutation(m)  # unique together
    want = np.lexsort((b, a))
    assert np.array_equal(_order([(a, 7), (b, max(m, 1))]), want)
    # bounds whose product does not fit in int64: lexsort itself
    assert np.array_equal(_order([(a, 1 << 40), (b, 1 << 40)]), want)
    c, d = rng.integers(0, 3, m), rng.integers(0, 50, m)  # four keys, as the rows' ranking
    want4 = np.lexsort((b, d, c, a))
    assert np.array_equal(_order([(a, 7), (c, 3), (d, 50), (b, max(m, 1))]), want4)


def test_context_matches_rank_by_count_then_recency():
    # suffix "1"; 2 followed 1 twice (latest at position 5), 3 once (position 8): 2 first, and it
    # continues with what followed its latest match
    row = np.array([0, 1, 2, 0, 1, 2, 5, 1, 3, 9, 1])
    paths, group = context_matches_np([row], 1, 1, 3, 2, 10)
    assert paths[0].tolist() == [[2, 5], [3, 9], [-1, -1]]
    assert group[0].tolist() == [0, 1, 0]


# ---------------------------------------------------------------------------- tables and drafters


def random_tables(V=12, k=4, w=5, seed=0) -> NGramTables:
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand((V, k), generator=g).sort(dim=1, descending=True).values.half()
    probs[0, -1] = 0  # a zero probability: logp clamps at 1e-12
    tensors = {
        "unigram": {"ids": torch.randperm(V, generator=g)[:k].int(), "probs": probs[1]},
        "bigram": {"ids": torch.randint(0, V, (V, k), generator=g).int(), "probs": probs},
        "extended": {"ids": torch.randint(0, V, (V, k, w), generator=g).int()},
    }
    return NGramTables(tensors, {"vocab_size": V})


def state_of(rows, last) -> DecodeState:
    tokens, lengths = padded(rows)
    B = len(rows)
    return DecodeState(
        tokens=tokens,
        lengths=lengths,
        last=torch.as_tensor(last),
        hidden=None,
        prompt_lengths=torch.zeros(B, dtype=torch.long),
        step=0,
        request_ids=torch.arange(B),
    )


def test_host_tables_equal_the_ngram_tables_lookups():
    tables = random_tables()
    host = HostTables(tables)
    last = torch.tensor([0, 5, 11, 5])
    for k in (1, 3, None):
        assert_same(tables.unigram_topk(k)[0], host.unigram_topk(k)[0])
        assert_same(tables.unigram_topk(k)[1], host.unigram_topk(k)[1])
        ids, probs = tables.bigram_topk(last, k)
        assert_same(ids, host.bigram_topk(last.numpy(), k)[0])
        assert_same(probs, host.bigram_topk(last.numpy(), k)[1])
        for w in (1, 5, None):
            assert_same(tables.extended(last, k, w), host.extended(last.numpy(), k, w))
    with pytest.raises(Exception, match="k=9"):
        host.extended(last.numpy(), 9)


@settings(max_examples=60, deadline=None)
@given(
    rows=rows_st,
    k=st.integers(1, 7),
    w=st.integers(1, 7),
    q=st.integers(1, 2),
    extra=st.integers(0, 2),
    seed=st.integers(0, 3),
)
def test_ngrammys_equals_the_torch_drafter(rows, k, w, q, extra, seed):
    tables = random_tables(seed=seed)
    last = [r[-1] if r else 7 for r in rows]
    drafter = NGrammysDrafter(tables, 12, k=k, w=w, q=q, q_max=q + extra)
    state = state_of(rows, last)
    if state.tokens.shape[1] == 0:
        return
    want = drafter.propose(state)
    paths, group = ngrammys_np(
        [np.array(r) for r in rows], np.array(last), HostTables(tables), 12, k, w, q, q + extra
    )
    assert_same(want.tokens, paths)
    assert_same(want.group, group)


def test_table_rows_equal_the_torch_drafter():
    tables = random_tables()
    host = HostTables(tables)
    rows, last = [[1, 2, 3], [4]], [3, 0]
    state = state_of(rows, last)
    for kind, k, w in (
        ("unigram", 3, None),
        ("bigram", 4, None),
        ("bigram", 2, None),
        ("extended", 3, 2),
        ("extended", 4, None),
    ):
        want = TableDrafter(tables, kind, k=k, w=w).propose(state)
        toks, logp = table_rows_np(kind, host, np.array(last), k, w)
        assert_same(want.tokens, toks)
        if want.logp is None:
            assert logp is None
        else:
            assert_same(want.logp, logp)
            # the fixed budget's node values (decoder.propose) at a path length of 3
            L = 3
            assert_same(
                pad_paths(want.logp.float().cumsum(-1).exp(), L).clamp_min(0),
                table_values_np(kind, host, np.array(last), k, L),
            )


# ---------------------------------------------------------------------------- statistics and budget


def test_host_stats_equal_the_torch_stats_over_many_steps():
    rng = np.random.default_rng(1)
    for nd, groups, depth in ((1, 32, 16), (3, 5, 4)):
        ts, hs = AcceptanceStats(nd, groups, depth), HostStats(nd, groups, depth)
        for _ in range(25):
            B, P, L = rng.integers(1, 4), rng.integers(0, 9), rng.integers(1, 20)
            owner = rng.integers(0, nd, P) if rng.random() < 0.7 else int(rng.integers(0, nd))
            group = rng.integers(-1, groups + 3, (B, P)) if rng.random() < 0.7 else None
            paths = rng.integers(-1, 5, (B, P, L))
            prefix = rng.integers(0, L + 1, (B, P))
            kept = rng.random((B, P, L)) < 0.7 if rng.random() < 0.5 else None
            tg = None if group is None else torch.tensor(group)
            assert_same(
                ts.values(torch.tensor(owner), (B, P, L), tg), hs.values(owner, (B, P, L), group)
            )
            ts.update(
                torch.tensor(owner),
                torch.tensor(paths),
                torch.tensor(prefix),
                tg,
                None if kept is None else torch.tensor(kept),
            )
            hs.update(owner, paths, prefix, group, kept)
            assert_same(ts.hits, hs.hits)
            assert_same(ts.tries, hs.tries)
            assert_same(ts.rates(), hs.rates())
        assert hs.hits.sum() > 0


@settings(max_examples=200, deadline=None)
@given(
    B=st.integers(1, 12),
    M=st.integers(0, 70),
    max_nodes=st.integers(0, 70),
    seed=st.integers(0, 10**6),
    flat=st.booleans(),
    overhead=st.floats(0, 0.01),
)
def test_best_budget_equals_the_torch_rule(B, M, max_nodes, seed, flat, overhead):
    rng = np.random.default_rng(seed)
    values = (rng.random((B, M)) ** rng.integers(1, 5) * 1.2 - 0.1).astype(np.float32)
    if seed % 3 == 0:
        values = np.round(values, 1).astype(np.float32)  # ties
    cost = (
        CostCurve.flat()
        if flat
        else CostCurve([1, 2, 4, 8, 16, 32, 64], (np.cumsum(rng.random(7) * 3e-3) + 1e-3).tolist())
    )
    want = int(best_budget(torch.tensor(values), cost, max_nodes, overhead)[0]) if B else 0
    assert best_budget_np(values, cost, max_nodes, overhead) == want
    n = B * (min(M, max_nodes) + 1)
    assert best_budget_np(values, cost.table(n, "cpu").numpy(), max_nodes, overhead) == want


def test_best_budget_needs_a_table_long_enough():
    with pytest.raises(Exception, match=r"c\(6\)"):
        best_budget_np(np.ones((2, 2), dtype=np.float32), np.ones(4, dtype=np.float32), 8)


# ---------------------------------------------------------------------------- the tree


def assert_same_tree(tree, host):
    for f in TREE_FIELDS:
        assert_same(getattr(tree, f), getattr(host, f))
    assert tree.max_depth == host.max_depth


def random_case(rng, B=None, P=None, L=None, V=None):
    B = int(rng.integers(1, 4)) if B is None else B
    P = int(rng.integers(0, 8)) if P is None else P
    L = int(rng.integers(0, 6)) if L is None else L
    paths = rng.integers(-1, V or int(rng.integers(1, 4)), (B, P, L))
    values = np.minimum.accumulate(rng.choice([0.1, 0.5, 0.5, 0.9], (B, P, L)), axis=-1).astype(
        np.float32
    )
    return paths, values


@pytest.mark.parametrize("seed", range(4))
def test_build_tree_equals_the_torch_tree(seed):
    rng = np.random.default_rng(seed)
    for _ in range(150):
        paths, values = random_case(rng)
        B = paths.shape[0]
        budget = [None, int(rng.integers(0, 8)), rng.integers(0, 8, B)][int(rng.integers(0, 3))]
        root = None if rng.random() < 0.3 else rng.integers(0, 3, B)
        size = (
            None if rng.random() < 0.4 else int(rng.integers(1, 14))
        )  # smaller and larger than the tree
        tb = torch.tensor(budget) if isinstance(budget, np.ndarray) else budget
        tree = build_tree(
            torch.tensor(paths),
            torch.tensor(values),
            tb,
            None if root is None else torch.tensor(root),
            size,
        )
        assert_same_tree(tree, build_tree_np(paths, values, budget, root, size))


@pytest.mark.parametrize("seed", range(3))
def test_a_large_batch_builds_from_the_entries_that_can_be_kept(seed):
    """Large batches with small budgets (and empty trailing paths) take the cut path of
    ``build_tree_np`` (no node deeper than the budget, no pair of empty paths compared); the
    tree must still equal the torch reference field by field, ties included."""
    rng = np.random.default_rng(100 + seed)
    for _ in range(12):
        B, P, L = int(rng.integers(24, 65)), int(rng.integers(6, 12)), int(rng.integers(6, 13))
        paths, values = random_case(rng, B, P, L, V=int(rng.integers(2, 5)))
        paths = np.where(rng.random((B, P, 1)) < 0.1, -1, paths)  # some rows drop a path
        paths[:, P - int(rng.integers(0, 4)) :] = -1  # empty in every row
        if rng.random() < 0.5:
            values = np.round(values, 1).astype(np.float32)
        budget = [int(rng.integers(1, 5)), rng.integers(0, 5, B), int(rng.integers(5, 30))][
            int(rng.integers(0, 3))
        ]
        root = rng.integers(0, 3, B)
        size = None if rng.random() < 0.5 else int(rng.integers(2, 10))
        tb = torch.tensor(budget) if isinstance(budget, np.ndarray) else budget
        tree = build_tree(torch.tensor(paths), torch.tensor(values), tb, torch.tensor(root), size)
        assert_same_tree(tree, build_tree_np(paths, values, budget, root, size))


def test_build_tree_edge_cases():
    root = np.array([7, 8])
    cases = [
        np.full((2, 3, 4), -1),
        np.zeros((2, 0, 4), dtype=np.int64),
        np.zeros((2, 3, 0), dtype=np.int64),
        np.array([[[1, 2], [1, 2], [1, 2]], [[3, -1], [3, 4], [3, 4]]]),  # duplicate paths
        np.array([[[1, -1, 2]], [[-1, 5, 6]]]),
    ]  # tokens after a PAD
    for paths in cases:
        values = np.full(paths.shape, 0.5, dtype=np.float32)
        for budget, size in ((None, None), (0, None), (0, 5), (2, None), (None, 9), (3, 4)):
            tree = build_tree(
                torch.tensor(paths), torch.tensor(values), budget, torch.tensor(root), size
            )
            host = build_tree_np(paths, values, budget, root, size)
            assert_same_tree(tree, host)
    host = build_tree_np(cases[3], None, None, root, 6)
    assert (
        host.num_nodes.tolist() == [3, 3] and host.valid.sum() == 6
    )  # shared once, 3 padding nodes a row


# ---------------------------------------------------------------------------- after the step


def torch_credit(paths, owner, tree, acc, nd):
    """Brute force over the device tree and acceptance: an entry is hit iff its node is on the
    accepted path; a drafter's credit is the accepted nodes (root excluded) any of its paths
    hold; a path's prefix is its leading hits."""
    B, P, L = paths.shape
    pn = tree.path_node.tolist()
    on = [set(n for n in row if n >= 0) for row in acc.path.tolist()]
    hit = torch.zeros((B, P, L), dtype=torch.bool)
    credit = torch.zeros((B, nd), dtype=torch.long)
    prefix = torch.zeros((B, P), dtype=torch.long)
    for b in range(B):
        nodes = [set() for _ in range(nd)]
        for p in range(P):
            lead = True
            for d in range(L):
                h = pn[b][p][d] >= 0 and pn[b][p][d] in on[b]
                hit[b, p, d] = h
                lead = lead and h
                prefix[b, p] += int(lead)
                if h and pn[b][p][d] != 0:
                    nodes[int(owner[p])].add(pn[b][p][d])
        credit[b] = torch.tensor([len(n) for n in nodes])
    return credit, hit, prefix


@pytest.mark.parametrize("seed", range(3))
def test_credit_hit_and_prefix_equal_a_brute_force_count(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        nd = int(rng.integers(1, 4))
        paths, values = random_case(rng, P=int(rng.integers(0, 9)), L=int(rng.integers(1, 5)), V=2)
        B, P, _ = paths.shape
        owner = np.sort(rng.integers(0, nd, P))
        budget = None if rng.random() < 0.5 else int(rng.integers(0, 8))
        size = None if rng.random() < 0.5 else 1 + 8 + int(rng.integers(0, 3))
        host = build_tree_np(paths, values, budget, rng.integers(0, 2, B), size)
        tree = build_tree(
            torch.tensor(paths), torch.tensor(values), budget, torch.tensor(host.tokens[:, 0]), size
        )
        logits = torch.randn(
            B, tree.size, 2, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30)))
        )
        acc = accept_greedy(tree, logits)
        credit, hit, prefix = torch_credit(torch.tensor(paths), torch.tensor(owner), tree, acc, nd)
        path = acc.path.numpy()  # what the host reads back
        h = hit_np(host, path)
        assert_same(hit, h)
        assert_same(credit, credit_np(host, path, owner, nd))
        assert_same(credit, credit_np(host, path, owner, nd, hit=h))
        assert_same(prefix, accepted_prefix_np(h))
        h2, credit2, prefix2 = step_feedback_np(host, path, owner, nd)  # the decoder's one call
        assert_same(hit, h2)
        assert_same(credit, credit2)
        assert_same(prefix, prefix2)


def test_credit_counts_a_shared_node_once_per_drafter():
    paths = np.array(
        [[[4, 5], [4, 6], [4, 5]]]
    )  # drafters 0, 1, 1: node "4" shared by both, "4 5" by 0 and 1
    host = build_tree_np(paths, root=np.array([0]))
    path = np.array([[0, 1, 2]])  # root, "4", "4 5"
    assert credit_np(host, path, np.array([0, 1, 1]), 2).tolist() == [[2, 2]]
    assert accepted_prefix_np(hit_np(host, path)).tolist() == [[2, 1, 2]]


# ---------------------------------------------------------------------------- compiled kernels


def test_the_compiled_kernels_equal_the_numpy_code_on_edge_inputs():
    """Inputs the torch references above never make: values at or below the dtype's lowest
    (they tie with the entries that are not nodes), negative budgets, tokens after a PAD, integer
    values, extended rows that are empty or PAD-padded, match length 0, a one-row batch."""
    from redraft.infer.spec import hostjit

    if not hostjit.ENABLED and hostjit.numba is None:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(11)
    lo = np.finfo(np.float32).min

    def both(fn, *a):
        was = hostjit.ENABLED
        try:
            hostjit.ENABLED = True
            got = fn(*a)
            hostjit.ENABLED = False
            return got, fn(*a)
        finally:
            hostjit.ENABLED = was

    for _ in range(300):
        B, P, L = int(rng.integers(1, 5)), int(rng.integers(1, 7)), int(rng.integers(1, 5))
        paths = rng.integers(-1, 3, (B, P, L))
        values = rng.choice(np.array([0.5, 0.5, lo, -np.inf, 0.9], np.float32), (B, P, L))
        if rng.random() < 0.2:
            values = rng.integers(0, 3, (B, P, L))  # not floats: ranked as float32
        budget = [int(rng.integers(-2, 9)), rng.integers(-1, 9, B), None][int(rng.integers(0, 3))]
        root = rng.integers(0, 3, B) if rng.random() < 0.7 else None
        size = None if rng.random() < 0.5 else int(rng.integers(1, 12))
        jit, ref = both(build_tree_np, paths, values, budget, root, size)
        for f in TREE_FIELDS:
            np.testing.assert_array_equal(getattr(jit, f), getattr(ref, f), err_msg=f)
            assert getattr(jit, f).dtype == getattr(ref, f).dtype
    tables = random_tables(seed=2)
    ids = tables.table("extended")["ids"].clone()
    ids[3, 1:] = -1  # token 3: one successor chain, then empty rows
    ids[4, 0, 2:] = -1  # token 4: a short first chain
    host = HostTables(extended=ids)
    for _ in range(200):
        rows = [
            rng.integers(0, 5, int(rng.integers(0, 30))) for _ in range(int(rng.integers(1, 4)))
        ]
        last = np.array([r[-1] if len(r) else 3 for r in rows])
        q, extra = int(rng.integers(0, 3)), int(rng.integers(0, 3))
        k, w = int(rng.integers(1, 8)), int(rng.integers(1, 7))
        for fn, a in (
            (context_matches_np, (rows, q, q + extra, k, w, 12, int(rng.integers(2, 40)))),
            (ngrammys_np, (rows, last, host, 12, k, w, max(q, 1), max(q, 1) + extra)),
        ):
            (p1, g1), (p2, g2) = both(fn, *a)
            np.testing.assert_array_equal(p1, p2)
            np.testing.assert_array_equal(g1, g2)
            assert p1.dtype == p2.dtype == np.int64 and g1.dtype == g2.dtype == np.int64
