"""The cost-aware beam width and length of the ReDrafter drafter (``redraft.infer.beamcost``)."""

import itertools

import numpy as np
import pytest
import torch

from redraft.errors import ConfigError
from redraft.infer.beamcost import BeamCost, curve_np, measure_beam_cost, novelty_np, plan_beam
from redraft.infer.budget import CostCurve
from redraft.infer.config import DecoderConfig
from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.redrafter import ReDrafterDrafter, beam_search

FLAT = CostCurve([1, 1024], [1.0, 1.0])


def test_the_module_docs_worked_example():
    cost = BeamCost.from_ms("1:100", "1:100,2:150")
    rates = np.array([[0.6, 0.5], [0.2, 0.5]])
    new = np.ones((2, 2))
    W, L, tps = plan_beam(rates, new, cost, FLAT, 1, [1, 2], [1, 2])
    assert (W, L) == (2, 2) and tps == pytest.approx(2.2 / 1.25)
    # dear extension steps: one token per beam, two beams (1.8 / 1.1)
    dear = BeamCost.from_ms("1:100", "1:400,2:450")
    assert plan_beam(rates, new, dear, FLAT, 1, [1, 2], [1, 2]) == (2, 1, pytest.approx(1.8 / 1.1))
    # a second beam that is never right: one beam of two tokens (1.9 / 1.2)
    weak = np.array([[0.6, 0.5], [0.0, 0.5]])
    assert plan_beam(weak, new, cost, FLAT, 1, [1, 2], [1, 2])[:2] == (1, 2)


def brute_force(rates, new, cost, verify, B, widths, lengths):
    """Every (W, L) and every K, nodes taken one by one by value (integer novelty only)."""
    best = None
    for W, L in itertools.product(widths, lengths):
        v = np.cumprod(rates[:W, :L], axis=1)
        v = np.minimum.accumulate(v, axis=0)
        vals = sorted((v[p, d] for p in range(W) for d in range(L) if new[p, d]), reverse=True)
        for K in range(len(vals) + 1):
            secs = float(verify(torch.tensor([B * (K + 1.0)]))[0]) + float(cost(B, W, L))
            tps = B * (1 + sum(vals[:K])) / secs
            if best is None or tps > best[2] + 1e-12:
                best = (W, L, tps)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_plan_matches_a_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    rates = rng.uniform(0.0, 0.5, size=(6, 5))  # per-depth sums stay below 1: no capping
    rates[:, 0] *= 1 / 3
    new = (rng.uniform(size=(6, 5)) < 0.7).astype(float)
    new[0] = 1
    verify = CostCurve([1, 4, 16, 64], sorted(rng.uniform(0.01, 0.1, size=4)))
    cost = BeamCost.from_ms("1:2,8:4", "1:1,4:2,16:6,64:20")
    B = int(rng.integers(1, 4))
    got = plan_beam(rates, new, cost, verify, B, range(1, 7), range(1, 6))
    want = brute_force(rates, new, cost, verify, B, range(1, 7), range(1, 6))
    assert got[:2] == want[:2] and got[2] == pytest.approx(want[2])


def test_a_depth_is_reached_no_more_often_than_the_one_above():
    # 8 distinct first tokens each accepted 40% of the time would be 3.2 tokens at depth 0:
    # the cap keeps depth 0 at one token at most, so 3 beams (1.2 capped to 1) cost more than
    # they can give over 2 (0.8) when a beam costs 0.1 s
    rates = np.full((8, 1), 0.4)
    cost = BeamCost.from_ms("1:100", "1:1")
    W, _, tps = plan_beam(rates, np.ones((8, 1)), cost, FLAT, 1, range(1, 9), [1])
    assert tps <= 2.0 / 1.1 + 1e-9


def test_novelty_counts_shared_prefixes_once():
    tokens = np.array(
        [
            [[5, 6, 7], [5, 6, 8], [5, 9, 7], [4, 6, 7]],
            [[1, 2, 3], [4, 5, 6], [1, 2, 3], [1, 2, 9]],
        ]
    )
    new = novelty_np(tokens)
    # row 0: beam 1 shares 5,6; beam 2 shares 5; beam 3 is new everywhere
    # row 1: beam 1 new; beam 2 equals beam 0 throughout; beam 3 shares 1,2
    want = np.array(
        [
            [[1, 1, 1], [0, 0, 1], [0, 1, 1], [1, 1, 1]],
            [[1, 1, 1], [1, 1, 1], [0, 0, 0], [0, 0, 1]],
        ]
    ).mean(axis=0)
    np.testing.assert_allclose(new, want)


def test_curve_np_is_the_cost_curve():
    curve = CostCurve([1, 4, 16], [0.01, 0.02, 0.05])
    n = np.array([0.5, 1, 2.5, 4, 10, 16, 40.5])
    np.testing.assert_allclose(curve_np(curve, n), curve(torch.tensor(n)).numpy())
    one = CostCurve([8], [0.3])
    np.testing.assert_allclose(curve_np(one, np.array([1.0, 64.0])), [0.3, 0.3])


def test_beam_cost_grows_with_width_and_length(tiny_head, tiny_target):
    ctx = torch.randn(1, tiny_target.model.config.hidden_size)
    last = torch.tensor([3])
    calls = []

    def search(c, y, w, n):
        calls.append((c.shape[0], w, n))
        return beam_search(tiny_head, c, y, w, n)

    cost = measure_beam_cost(search, ctx, last, max_rows=16, repeats=1)
    assert cost.first.sizes.tolist() == [1, 2, 4, 8, 16] == cost.ext.sizes.tolist()
    assert {(n, 1, 1) for n in (1, 2, 4, 8, 16)} <= set(calls)  # first(n): n rows, 1 x 1
    assert {(1, n, 3) for n in (1, 2, 4, 8, 16)} <= set(calls)  # ext(n): 1 row, n beams, 1 + 2
    assert (cost.ext.seconds > 0).all() and (cost.ext.seconds.diff() >= 0).all()
    one, longer, wider = cost(1, 4, 2), cost(1, 4, 5), cost(1, 16, 2)
    assert longer > one and wider >= one
    assert cost(2, 4, 3) == pytest.approx(curve_np(cost.first, 2.0) + 2 * curve_np(cost.ext, 8.0))


def test_config_takes_auto_or_numbers():
    cfg = DecoderConfig(redrafter_width="auto", redrafter_length="auto")
    assert (cfg.redrafter_width, cfg.redrafter_length) == ("auto", "auto")
    cfg = DecoderConfig(redrafter_width="4", redrafter_length="3")  # from a flag
    assert (cfg.redrafter_width, cfg.redrafter_length) == (4, 3)
    assert DecoderConfig().redrafter_length is None
    for key, bad in (("redrafter_width", "wide"), ("redrafter_width", 0), ("redrafter_length", -1)):
        with pytest.raises(ConfigError, match=key) as err:
            DecoderConfig(**{key: bad})
        assert "auto" in str(err.value) and err.value.param == key


def test_fixed_width_and_length_are_honoured(tiny_target, tiny_head, tiny_prompts):
    dr = ReDrafterDrafter(tiny_head, width=3, length=2)
    dec = SpeculativeDecoder(tiny_target, [dr], cost_curve=FLAT)
    dec.generate(tiny_prompts, max_new_tokens=12)
    assert set(dr.plans) == {(3, 2)} and dr.beam_cost is None  # nothing measured


def test_auto_changes_width_and_length_mid_run_and_output_is_plain_greedy(
    tiny_target, tiny_head, tiny_prompts, monkeypatch
):
    """A random head's beams, its (W, L) switched every few steps: the output must not move."""
    import redraft.infer.drafters.redrafter as rd

    schedule = itertools.cycle([(1, 1), (5, 4), (2, 3), (9, 2), (3, 5)])
    monkeypatch.setattr(rd, "plan_beam", lambda *a, **k: (*next(schedule), 1.0))
    dr = ReDrafterDrafter(tiny_head, width="auto", length="auto")
    dr.REPLAN = 2
    dec = SpeculativeDecoder(tiny_target, [dr], cost_curve=FLAT)
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=40)
    out = dec.generate(tiny_prompts, max_new_tokens=40)
    assert [g.tokens for g in out] == [g.tokens for g in ref]
    assert len(dr.plans) >= 4  # it did change mid-run
    assert dr.beam_cost is not None  # measured once, at the first plan


def test_auto_plans_from_the_decoders_rates_and_output_is_plain_greedy(
    tiny_target, tiny_head, tiny_prompts
):
    verify = CostCurve([1, 8, 64], [0.01, 0.012, 0.03])
    cost = BeamCost.from_ms("1:0.1", "1:0.1,16:0.5")
    dr = ReDrafterDrafter(tiny_head, width="auto", length="auto", beam_cost=cost)
    dec = SpeculativeDecoder(tiny_target, [dr], cost_curve=verify)
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=40)
    out = dec.generate(tiny_prompts, max_new_tokens=40)
    assert [g.tokens for g in out] == [g.tokens for g in ref]
    # the first plan knows only the rates' prior; the random head is almost never right, so
    # later plans shrink the search: deep nodes of a useless head are not worth verifying
    assert len(dr.plans) >= 2 and max(L for _, L in dr.plans) <= 2
    assert dr.width * dr.length < 8 * tiny_head.config.num_steps


def test_only_an_auto_setting_is_planned(tiny_head):
    dr = ReDrafterDrafter(tiny_head, width="auto", length=2)
    assert dr.lengths == [2] and dr.widths[-1] == 16 and dr.auto
    dr = ReDrafterDrafter(tiny_head, width=4, length="auto")
    assert dr.widths == [4] and dr.lengths == list(range(1, tiny_head.config.num_steps + 1))
    assert not ReDrafterDrafter(tiny_head, width=4).auto


def test_ranks_and_depths_past_the_statistics_reuse_the_last_ones():
    rates = np.array([[0.5, 0.4]])  # one rank, two depths known
    cost = BeamCost.from_ms("1:1", "1:1")
    short = plan_beam(rates, np.ones((3, 4)), cost, FLAT, 1, [1, 2, 3], [1, 2, 3, 4])
    full = np.array([[0.5, 0.4, 0.4, 0.4]] * 3)
    assert short == plan_beam(full, np.ones((3, 4)), cost, FLAT, 1, [1, 2, 3], [1, 2, 3, 4])
