"""redraft.bench.ties: the first divergence and the float32 referee's verdict on it."""

import torch

from redraft.bench.ties import NEAR_TIE, Divergence, first_divergence


def _logits(target, ids):
    with torch.no_grad():
        return target.model(torch.tensor([ids])).logits[0, -1].float()


def test_no_divergence_on_a_shared_prefix(tiny_target):
    assert first_divergence(tiny_target, [1, 2, 3], [5, 6, 7], [5, 6, 7]) is None
    assert first_divergence(tiny_target, [1, 2, 3], [5, 6], [5, 6, 7]) is None  # one ran longer


def test_the_referee_reads_the_logits_after_the_shared_prefix(tiny_target):
    prompt, want = [3, 1, 4, 1, 5], [9, 2, 6, 5]
    logits = _logits(tiny_target, prompt + want[:2])
    order = logits.argsort(descending=True).tolist()
    got = want[:2] + [order[0]]  # differs at index 2 with the referee's favourite
    want = want[:2] + [order[-1]] + want[3:]  # against its least likely token
    d = first_divergence(tiny_target, prompt, got, want)
    assert (d.index, d.got, d.want) == (2, order[0], order[-1])
    assert d.got_logit == float(logits[order[0]]) and d.want_logit == float(logits[order[-1]])
    assert (d.rank_got, d.rank_want) == (1, tiny_target.vocab_size)
    assert not d.near_tie and "NOT a near-tie" in d.describe()
    # the top two tokens: ranks 1 and 2, a near-tie only when their logits are close
    d2 = first_divergence(tiny_target, prompt, want[:2] + [order[1]], want[:2] + [order[0]])
    assert (d2.rank_got, d2.rank_want) == (2, 1)
    assert d2.near_tie == (float(logits[order[0]] - logits[order[1]]) < NEAR_TIE)


def test_near_tie_needs_both_a_small_gap_and_top_ranks():
    assert Divergence(0, 1, 2, 5.0, 5.2, 2, 1).near_tie
    assert not Divergence(0, 1, 2, 5.0, 6.5, 2, 1).near_tie  # a clear preference
    assert not Divergence(0, 1, 2, 5.0, 5.1, 4, 1).near_tie  # close, but below the top 3
    assert "near-tie that rounding flips" in Divergence(3, 1, 2, 5.0, 5.2, 2, 1).describe()
