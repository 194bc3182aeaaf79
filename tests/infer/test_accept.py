"""Acceptance rules on hand-made trees, and rejection sampling keeps the target distribution."""

import pytest
import torch

from redraft.infer.accept import accept_greedy, accept_rejection, accept_typical, accepted_tokens, emitted_tokens
from redraft.infer.tree import build_tree

scipy_stats = pytest.importorskip("scipy.stats")


def logits_for(tree, table):
    """Logits [1, N, V] where node n's argmax follows ``table[token of n]`` (a bigram world)."""
    V = table.shape[0]
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
    acc = accept_typical(tree, logits_for(tree, logits))
    # p(1) = .45 > min(.3, .09 exp(-H)) twice; p(3) = .01 is below the threshold
    assert accepted_tokens(tree, acc)[0].tolist() == [1, 1]
    assert int(acc.bonus[0]) == 0
    strict = accept_typical(tree, logits_for(tree, logits), eps=0.3, delta=10.0)  # threshold .3
    assert int(strict.num_accepted[0]) == 2  # .45 > .3 still


def test_rejection_sampling_keeps_the_target_distribution():
    """Deterministic siblings at the root, a child sampled from q under one of them: the first
    two emitted tokens must follow p(t1) p(t2 | t1) exactly (chi-square; rows = seeds)."""
    V, n = 6, 20000
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g) * 1.5  # logits of the next token after token t
    p = table.softmax(-1)
    q_dist = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.5, 0.1])
    sampled = torch.multinomial(q_dist, n, replacement=True, generator=g)  # one draw per row
    paths = torch.tensor([[2, 3], [4, 0], [1, 5]]).expand(n, -1, -1).clone()
    paths[:, 1, 1] = sampled  # node "4 -> s" with s ~ q, the only child of 4
    tree = build_tree(paths)
    assert tree.tokens[0, :4].tolist() == [-1, 2, 3, 4]
    q = torch.zeros((n, tree.size, V))
    q[:, 4] = q_dist  # node 4 = the sampled token (path 1, depth 2)
    acc = accept_rejection(tree, logits_for(tree, table), temperature=1.0, node_q=q, generator=g)
    toks = emitted_tokens(tree, acc)
    first, second = toks[:, 0], toks[:, 1]
    obs = torch.bincount(first, minlength=V).double()
    exp = p[0].double() / p[0].double().sum() * n
    assert scipy_stats.chisquare(obs, exp).pvalue > 1e-3
    for t1 in range(V):
        rows = (first == t1) & (second >= 0)
        if rows.sum() < 500:
            continue
        obs = torch.bincount(second[rows], minlength=V).double()
        exp = p[t1].double() / p[t1].double().sum() * obs.sum()
        keep = exp > 5
        stat = scipy_stats.chisquare(obs[keep], exp[keep] / exp[keep].sum() * obs[keep].sum())
        assert stat.pvalue > 1e-3, (t1, obs, exp)
    # the sampled child was actually exercised
    assert ((first == 4) & (acc.num_accepted == 2)).sum() > 1000
