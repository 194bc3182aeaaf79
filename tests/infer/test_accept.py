"""Acceptance rules on hand-made trees, and rejection sampling keeps the target distribution."""

import pytest
import torch
from reference.accept import (
    accept_greedy,
    accept_rejection,
    accept_typical,
    accepted_tokens,
    emitted_tokens,
)
from reference.tree import build_tree

from redraft.infer.spec.accept import RowSampling, warp_probs


def logits_for(tree, table):
    """Logits [1, N, V] where node n's argmax follows ``table[token of n]`` (a bigram world)."""
    toks = tree.tokens.clamp_min(0)
    toks[:, 0] = 0  # the root token is 0 in these tests
    return table[toks]


def test_greedy_takes_the_deepest_correct_path():
    # world: 0 -> 1 -> 2 -> 3 -> ... (argmax of token t is t+1)
    V = 8
    table = torch.full((V, V), -5.0)
    table[torch.arange(V), (torch.arange(V) + 1) % V] = 5.0
    paths = torch.tensor([[[1, 2, 7], [1, 2, 3], [4, 5, 6]]])
    tree = build_tree(paths)
    acc = accept_greedy(tree, logits_for(tree, table))
    assert int(acc.num_accepted[0]) == 3
    assert accepted_tokens(tree, acc)[0].tolist() == [1, 2, 3]
    assert int(acc.bonus[0]) == 4
    # nothing correct: bonus only
    tree = build_tree(torch.tensor([[[5, 6, 7]]]))
    acc = accept_greedy(tree, logits_for(tree, table))
    assert int(acc.num_accepted[0]) == 0 and int(acc.bonus[0]) == 1
    assert acc.path[0].tolist() == [0, -1, -1, -1]


def test_typical_accepts_likely_non_argmax_tokens_only():
    V = 4
    logits = torch.log(torch.tensor([[0.5, 0.45, 0.04, 0.01]])).expand(V, V).clone()
    tree = build_tree(torch.tensor([[[1, 1], [3, 0]]]))  # token 1 has p=.45, token 3 p=.01
    greedy = RowSampling.uniform(1)
    acc = accept_typical(tree, logits_for(tree, logits), greedy)
    # p(1) = .45 > min(.3, .09 exp(-H)) twice; p(3) = .01 is below the threshold
    assert accepted_tokens(tree, acc)[0].tolist() == [1, 1]
    assert int(acc.bonus[0]) == 0
    strict = accept_typical(
        tree, logits_for(tree, logits), greedy, eps=0.3, delta=10.0
    )  # threshold .3
    assert int(strict.num_accepted[0]) == 2  # .45 > .3 still


def test_typical_accepts_exactly_the_tokens_above_the_threshold():
    """The defining property, node by node: a child is acceptable iff p(t | parent) exceeds
    min(eps, delta * exp(-H(p(. | parent)))) or is the parent's argmax."""
    g = torch.Generator().manual_seed(3)
    V = 6
    table = torch.randn(V, V, generator=g) * 2
    p = table.softmax(-1)
    H = -(p * p.log()).sum(-1)
    eps, delta = 0.3, 0.5
    thresh = torch.minimum(torch.full((V,), eps), delta * torch.exp(-H))
    for t1 in range(V):
        for t2 in range(V):
            tree = build_tree(torch.tensor([[[t1, t2]]]))
            acc = accept_typical(
                tree, logits_for(tree, table), RowSampling.uniform(1), eps=eps, delta=delta
            )
            ok1 = bool(p[0, t1] > thresh[0]) or t1 == int(p[0].argmax())
            ok2 = ok1 and (bool(p[t1, t2] > thresh[t1]) or t2 == int(p[t1].argmax()))
            assert int(acc.num_accepted[0]) == ok1 + ok2, (t1, t2)


def test_rejection_sampling_keeps_the_target_distribution():
    """Siblings at the root and a chain below one of them: the first two emitted tokens must
    follow p(t1) p(t2 | t1) exactly (chi-square; rows = seeds), at temperature 0.7 and top-p."""
    from scipy.stats import chisquare

    V, n = 6, 20000
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g) * 1.5  # logits of the next token after token t
    paths = torch.tensor([[2, 3], [4, 0], [1, 5]]).expand(n, -1, -1).clone()
    paths[:, 1, 1] = torch.randint(
        0, V, (n,), generator=g
    )  # node "4 -> s": a different child per row
    tree = build_tree(paths)
    assert tree.tokens[0, :4].tolist() == [-1, 2, 3, 4]
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        rows = RowSampling.uniform(n, temperature, top_p, generator=g)
        acc = accept_rejection(tree, logits_for(tree, table), rows)
        p = warp_probs(table, temperature, top_p).double()
        toks = emitted_tokens(tree, acc)
        first, second = toks[:, 0], toks[:, 1]
        obs = torch.bincount(first, minlength=V).double()
        keep = p[0] > 0
        assert obs[~keep].sum() == 0  # nothing outside the nucleus
        assert chisquare(obs[keep], p[0][keep] / p[0][keep].sum() * obs[keep].sum()).pvalue > 1e-3
        for t1 in range(V):
            sel = (first == t1) & (second >= 0)
            if sel.sum() < 500:
                continue
            obs = torch.bincount(second[sel], minlength=V).double()
            keep = p[t1] > 0
            assert obs[~keep].sum() == 0
            if keep.sum() > 1:  # a one-token nucleus: the assert above is the whole check
                exp = p[t1][keep] / p[t1][keep].sum() * obs[keep].sum()
                assert chisquare(obs[keep], exp).pvalue > 1e-3, (t1, obs, exp)
        # the drafts were used: rows went down the tree past the root
        assert ((first == 4) & (acc.num_accepted == 2)).sum() > 100


def test_rows_of_one_batch_sample_with_their_own_settings():
    """A greedy row, a sampled row and a seeded row in one batch: the greedy row is the argmax,
    the seeded row repeats with its seed whatever its neighbours do."""
    V = 8
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(1))
    tree = build_tree(torch.tensor([[[1, 2]], [[1, 2]], [[1, 2]]]))
    logits = logits_for(tree, table)

    def run(other_seed):
        gens = [None, torch.Generator().manual_seed(other_seed), torch.Generator().manual_seed(7)]
        rows = RowSampling([0.0, 1.0, 1.0], [1.0, 1.0, 0.8], gens)
        return emitted_tokens(tree, accept_rejection(tree, logits, rows))

    a, b = run(1), run(2)
    greedy = emitted_tokens(tree, accept_greedy(tree, logits))
    assert a[0].tolist() == greedy[0].tolist()
    assert a[2].tolist() == b[2].tolist()  # the seeded row does not depend on the others


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "numpy"])
@pytest.mark.parametrize("rule", ["greedy", "rejection", "typical"])
def test_the_host_walk_over_device_choices_equals_the_device_rules(rule, jit, monkeypatch):
    """The decoder's split (``step_choices`` on the device, ``walk`` on the host over the numpy
    tree) accepts exactly what the device rules accept, path, count and bonus; with the compiled
    walk (``redraft.infer.spec.hostjit``) and the numpy one."""
    import numpy as np

    from redraft.infer.spec import hostjit

    if jit and hostjit.numba is None:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(hostjit, "ENABLED", jit)

    from reference.accept import ACCEPT
    from reference.tree import build_tree

    from redraft.infer.spec.accept import RowSampling, seed_uniforms, step_choices, walk
    from redraft.infer.spec.hosttree import build_tree_np

    rng = np.random.default_rng(7)
    V = 5
    for case in range(40):
        B, P, L = 3, int(rng.integers(1, 6)), int(rng.integers(1, 5))
        paths = rng.integers(-1, V, (B, P, L))
        root = rng.integers(0, V, B)
        size = None if case % 2 else 1 + P * L + 2
        tree = build_tree(torch.tensor(paths), root=torch.tensor(root), size=size)
        host = build_tree_np(paths, root=root, size=size)
        logits = torch.randn(B, tree.size, V, generator=torch.Generator().manual_seed(case)) * 2
        temps = [0.0, 0.8, 1.3] if rule != "greedy" else [0.0] * 3
        rows = RowSampling(
            temps,
            [1.0, 0.9, 1.0],
            None,
            "cpu",
            uniforms=[seed_uniforms(case * 3 + r, 64) for r in range(B)],
        )
        rows.offset = torch.tensor([2, 0, 5])
        ref = ACCEPT[rule](tree, logits, rows)
        got = walk(
            rule,
            host,
            step_choices(rule, tree.tokens, tree.parent, tree.depth, logits, rows).numpy(),
        )
        assert got.num_accepted.tolist() == ref.num_accepted.tolist()
        assert got.last_node.tolist() == ref.last_node.tolist()
        assert got.bonus.tolist() == ref.bonus.tolist()
        assert got.path.tolist() == ref.path.tolist()
        emitted = emitted_tokens(tree, ref)
        assert got.emitted == [
            r[: n + 1] for r, n in zip(emitted.tolist(), ref.num_accepted.tolist())
        ]
