"""Drafters against brute-force references; the budget model."""

import numpy as np
import pytest
import torch
from reference.budget import AcceptanceStats, best_budget

from redraft.infer.drafters.ngram import GROUPS_PER_CLASS, NGrammysDrafter, context_matches_multi
from redraft.infer.drafters.redrafter.drafter import beam_search
from redraft.infer.runner.cost import CostCurve
from redraft.infer.spec.drafter import DecodeState


def brute_context(seq, q, k, w):
    """Reference: candidates after earlier matches of seq[-q:], ranked by (count of first token,
    most recent match), each continued from its most recent match."""
    suffix = seq[-q:]
    by_first = {}
    for j in range(len(seq) - q):
        if seq[j : j + q] == suffix:
            f = seq[j + q]
            c, _ = by_first.get(f, (0, -1))
            by_first[f] = (c + 1, j)
    ranked = sorted(by_first.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:k]
    out = []
    for _first, (_, j) in ranked:
        cont = seq[j + q : j + q + w]
        out.append(cont + [-1] * (w - len(cont)))
    return out + [[-1] * w] * (k - len(out))


def brute_context_multi(seq, q_min, q_max, k, w):
    """Reference: rows of every match length, longest first, a first token only once."""
    rows, groups, seen = [], [], set()
    for c, q in enumerate(range(q_max, q_min - 1, -1)):
        rank = 0
        for r in brute_context(seq, q, k, w) if len(seq) > q else []:
            if r[0] < 0 or r[0] in seen:
                continue
            seen.add(r[0])
            rows.append(r)
            groups.append(c * GROUPS_PER_CLASS + min(rank, GROUPS_PER_CLASS - 1))
            rank += 1
    rows, groups = rows[:k], groups[:k]
    return rows + [[-1] * w] * (k - len(rows)), groups


def test_context_matches_multi_equal_brute_force():
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        B, T, V = 3, 40, int(torch.randint(3, 7, (1,), generator=g))
        toks = torch.randint(0, V, (B, T), generator=g)
        lengths = torch.randint(2, T + 1, (B,), generator=g)
        toks = torch.where(torch.arange(T)[None] < lengths[:, None], toks, -1)
        for q_min, q_max, k in ((1, 3, 5), (1, 3, 2), (2, 4, 3), (1, 1, 3), (2, 2, 4), (3, 3, 4)):
            paths, group = context_matches_multi(
                toks, lengths, q_min=q_min, q_max=q_max, k=k, w=3, vocab_size=V
            )
            for b in range(B):
                rows, groups = brute_context_multi(
                    toks[b, : lengths[b]].tolist(), q_min, q_max, k, 3
                )
                assert paths[b].tolist() == rows, (q_min, q_max, k)
                assert group[b, : len(groups)].tolist() == groups


def test_ngrammys_fills_rows_with_context_first(tiny_tables):
    toks = torch.tensor([[5, 9, 7, 5, 9, 8, 5, -1]])
    state = DecodeState(
        tokens=toks,
        lengths=torch.tensor([7]),
        last=torch.tensor([5]),
        hidden=None,
        prompt_lengths=torch.tensor([3]),
        step=0,
        request_ids=torch.tensor([0]),
    )
    d = NGrammysDrafter(tiny_tables, vocab_size=384, k=4, w=3).propose(state)
    assert d.tokens.shape == (1, 4, 3)
    # "5" was followed by 9 twice: one context row (distinct first tokens), continued from the
    # most recent match; the other rows are the extended bigram chains of 5
    assert d.tokens[0, 0].tolist() == [9, 8, 5]
    assert d.tokens[0, 1:].tolist() == tiny_tables.extended(torch.tensor([5]))[0, :3, :3].tolist()


@torch.no_grad()
def test_beam_search_matches_reference(tiny_head):
    ctx = torch.randn(2, tiny_head.config.hidden_size)
    last = torch.tensor([3, 17])
    W = 3
    toks, logp, score = beam_search(tiny_head, ctx, last, width=W, length=2)
    for b in range(2):
        s0, lg0 = tiny_head.step(None, ctx[b : b + 1], last[b : b + 1])
        lp0 = lg0.float().log_softmax(-1)[0]
        first = lp0.topk(W).indices
        cands = []
        for t in first.tolist():
            _, lg1 = tiny_head.step(s0, ctx[b : b + 1], torch.tensor([t]))
            lp1 = lg1.float().log_softmax(-1)[0]
            for v in range(lp1.shape[0]):
                cands.append((float(lp0[t] + lp1[v]), t, v, float(lp1[v])))
        best = sorted(cands, key=lambda c: -c[0])[:W]
        assert toks[b].tolist() == [[t, v] for _, t, v, _ in best]
        torch.testing.assert_close(score[b], torch.tensor([c[0] for c in best]), atol=1e-5, rtol=0)
        torch.testing.assert_close(
            logp[b, :, 1], torch.tensor([c[3] for c in best]), atol=1e-5, rtol=0
        )


def test_best_budget_maximises_tokens_per_second():
    cost = CostCurve([1, 2, 4, 8], [1.0, 1.1, 1.3, 2.0])
    one = torch.tensor([[0.9, 0.8, 0.1, 0.05, 0.01, 0.0, 0.0]])
    # K=2 gives 2.7/c(3)=2.7/1.2=2.25; K=3: 2.8/1.3=2.15; K=1: 1.9/1.1=1.73
    assert best_budget(one, cost, max_nodes=7).tolist() == [2]
    assert best_budget(one, CostCurve.flat(), max_nodes=7)[0] >= 5
    # a batch shares one K maximising (B + sum of the rows' top-K values) / c(B * (K + 1))
    batch = torch.tensor([[0.9, 0.8, 0.1, 0.05], [0.6, 0.0, 0.0, 0.0], [0.9, 0.9, 0.9, 0.9]])
    B = batch.shape[0]
    top = batch.sort(dim=1, descending=True).values
    score = [(B + top[:, :k].sum()) / float(cost(torch.tensor(B * (k + 1)))) for k in range(5)]
    want = max(range(5), key=lambda k: score[k])
    assert best_budget(batch, cost, max_nodes=4).tolist() == [want] * B
    assert best_budget(batch, cost, max_nodes=1).tolist() == [min(want, 1)] * B


def test_cost_curve_interpolates_and_extrapolates_linearly():
    cost = CostCurve([1, 4, 8], [1.0, 1.3, 2.1])
    assert float(cost(torch.tensor(2))) == pytest.approx(1.1)
    assert float(cost(torch.tensor(16))) == pytest.approx(
        2.1 + 8 * 0.2
    )  # slope of the last segment
    assert float(cost(torch.tensor(0))) == pytest.approx(1.0)


def test_acceptance_stats_learn_rates_per_depth():
    st = AcceptanceStats(1, decay=1.0, prior_weight=0.0)
    toks = torch.tensor([[[1, 2, 3], [4, 5, -1]]])
    st.update(0, toks, torch.tensor([[2, 0]]))  # path 0: 2 of 3 accepted; path 1: none
    r = st.rates()[0]
    assert r[0, 0] == 1.0 and r[0, 1] == 1.0 and r[0, 2] == 0.0
    assert r[1, 0] == 0.0
    v = st.values(0, (1, 2, 3))
    assert v[0, 0].tolist() == [1.0, 1.0, 0.0]


def test_acceptance_stats_learn_rates_per_group():
    st = AcceptanceStats(1, decay=1.0, prior_weight=0.0)
    toks = torch.tensor([[[1, 2], [3, 4], [5, 6]]])
    # paths 0 and 2 are group 7 (0 fully accepted, 2 not at all), path 1 is group 2
    st.update(0, toks, torch.tensor([[2, 1, 0]]), group=torch.tensor([[7, 2, 7]]))
    r = st.rates()[0]
    assert r[7, 0] == 0.5 and r[7, 1] == 1.0  # depth 0 tried by paths 0 and 2, depth 1 by path 0
    assert r[2, 0] == 1.0 and r[2, 1] == 0.0
    v = st.values(0, (1, 2, 2), group=torch.tensor([[2, 7]]))
    assert v[0].tolist() == [[1.0, 0.0], [0.5, 0.5]]


def test_an_untried_depth_is_expected_to_be_accepted_like_the_depth_above_it():
    from redraft.infer.spec.hoststats import HostStats

    toks = torch.tensor([[[1, 2, 3, 4]]])
    kept = torch.tensor([[[True, False, False, False]]])  # only depth 0 was verified
    for st, conv in (
        (AcceptanceStats(1, decay=1.0), torch.as_tensor),
        (HostStats(1, decay=1.0), np.asarray),
    ):
        for _ in range(8):  # accepted 8 times out of 8
            st.update(0, conv(toks), conv(torch.tensor([[1]])), kept=conv(kept))
        r = torch.as_tensor(st.rates())[0, 0]
        assert float(r[0]) == pytest.approx((8 + 0.6) / (8 + 2))  # the prior: 0.3, weight 2
        # never verified: each deeper depth has the depth above as its prior's mean
        assert r[1:4].tolist() == pytest.approx([float(r[0])] * 3)
        v = torch.as_tensor(st.values(0, (1, 1, 4)))[0, 0]
        assert v.tolist() == pytest.approx([float(r[0]) ** (i + 1) for i in range(4)])
