"""The cost-aware beam width and length of the ReDrafter drafter (``redraft.infer.drafters.redrafter.beamcost``)."""

import itertools

import numpy as np
import pytest
import torch

from redraft.errors import ConfigError
from redraft.infer.config import DecoderConfig
from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.redrafter.beamcost import (
    MAX_SPLIT,
    BeamCost,
    beam_group,
    curve_np,
    measure_beam_cost,
    plan_beam,
    split_depth_np,
)
from redraft.infer.drafters.redrafter.drafter import ReDrafterDrafter, beam_search
from redraft.infer.runner.cost import CostCurve

FLAT = CostCurve([1, 1024], [1.0, 1.0])


def by_group(per_beam):
    """``[30, D]`` rates by statistics group from ``{(rank, split depth): rates}`` (others 0)."""
    D = len(next(iter(per_beam.values())))
    rates = np.zeros(((MAX_SPLIT + 1) * 5, D))
    for (p, f), r in per_beam.items():
        rates[beam_group(p, f)] = r
    return rates


def at_zero(W):
    """Every beam splits at depth 0."""
    split = np.zeros((W, MAX_SPLIT + 1))
    split[:, 0] = 1
    return split


def test_the_module_docs_worked_example():
    cost = BeamCost.from_ms("1:100", "1:100,2:150")
    rates = by_group({(0, 0): [0.6, 0.5], (1, 0): [0.2, 0.5]})
    W, L, tps = plan_beam(rates, at_zero(2), cost, FLAT, 1, [1, 2], [1, 2])
    assert (W, L) == (2, 2) and tps == pytest.approx(2.2 / 1.25)
    # dear extension steps: one token per beam, two beams (1.8 / 1.1)
    dear = BeamCost.from_ms("1:100", "1:400,2:450")
    got = plan_beam(rates, at_zero(2), dear, FLAT, 1, [1, 2], [1, 2])
    assert got == (2, 1, pytest.approx(1.8 / 1.1))
    # a second beam that is never right: one beam of two tokens (1.9 / 1.2)
    weak = by_group({(0, 0): [0.6, 0.5], (1, 0): [0.0, 0.5]})
    assert plan_beam(weak, at_zero(2), cost, FLAT, 1, [1, 2], [1, 2])[:2] == (1, 2)


def test_a_beam_that_shares_its_first_token_adds_only_its_later_nodes():
    # beam 1 always shares beam 0's first token: its depth-0 entry is beam 0's node; its one
    # new node, at depth 1, is worth 0.6 * 0.5
    cost = BeamCost.from_ms("1:1", "1:1")
    split = np.zeros((2, MAX_SPLIT + 1))
    split[0, 0] = split[1, 1] = 1
    rates = by_group({(0, 0): [0.6, 0.0], (1, 1): [0.6, 0.5]})
    W, L, tps = plan_beam(rates, split, cost, FLAT, 1, [1, 2], [1, 2])
    assert (W, L) == (2, 2) and tps == pytest.approx((1 + 0.6 + 0.3) / 1.002)


def brute_force(rates, split, cost, verify, B, widths, lengths):
    """Every (W, L) and every K, nodes taken one by one by value (each beam one split depth)."""
    best = None
    f = split.argmax(axis=1)
    for W, L in itertools.product(widths, lengths):
        v = np.zeros((W, (MAX_SPLIT + 1), L))
        for p in range(W):
            for g in range(MAX_SPLIT + 1):
                v[p, g] = np.cumprod(rates[beam_group(p, g), :L])
                if p > 1 or (p == 1 and g == 0):  # beam 0 only splits at depth 0
                    v[p, g] = np.minimum(v[p, g], v[p - 1, g])
        vals = sorted((v[p, f[p], d] for p in range(W) for d in range(f[p], L)), reverse=True)
        for K in range(len(vals) + 1):
            secs = float(verify(torch.tensor([B * (K + 1.0)]))[0]) + float(cost(B, W, L))
            tps = B * (1 + sum(vals[:K])) / secs
            if best is None or tps > best[2] + 1e-12:
                best = (W, L, tps)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_plan_matches_a_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    rates = rng.uniform(0.0, 0.5, size=((MAX_SPLIT + 1) * 5, 5))  # depth sums stay below 1
    rates[:, 0] *= 1 / 3
    split = np.zeros((6, MAX_SPLIT + 1))
    split[np.arange(6), [0, *sorted(rng.integers(0, 3, size=5))]] = 1  # one split per beam
    verify = CostCurve([1, 4, 16, 64], sorted(rng.uniform(0.01, 0.1, size=4)))
    cost = BeamCost.from_ms("1:2,8:4", "1:1,4:2,16:6,64:20")
    B = int(rng.integers(1, 4))
    got = plan_beam(rates, split, cost, verify, B, range(1, 7), range(1, 6))
    want = brute_force(rates, split, cost, verify, B, range(1, 7), range(1, 6))
    assert got[:2] == want[:2] and got[2] == pytest.approx(want[2])


def test_a_depth_is_reached_no_more_often_than_the_one_above():
    # 8 distinct first tokens each accepted 40% of the time would be 3.2 tokens at depth 0:
    # the cap keeps depth 0 at one token at most
    rates = np.full(((MAX_SPLIT + 1) * 5, 1), 0.4)
    cost = BeamCost.from_ms("1:100", "1:1")
    W, _, tps = plan_beam(rates, at_zero(8), cost, FLAT, 1, range(1, 9), [1])
    assert tps <= 2.0 / 1.1 + 1e-9


def test_split_depth_is_the_longest_prefix_shared_with_a_better_beam():
    tokens = np.array(
        [
            [[5, 6, 7], [5, 6, 8], [5, 9, 7], [4, 6, 7]],
            [[1, 2, 3], [4, 5, 6], [1, 2, 9], [1, 7, 9]],
        ]
    )
    np.testing.assert_array_equal(split_depth_np(tokens), [[0, 2, 1, 0], [0, 0, 2, 1]])
    assert beam_group(0, 0) == 0 and beam_group(5, 2) == 2 * 5 + 3 and beam_group(40, 9) == 29


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
    assert (DecoderConfig().redrafter_width, DecoderConfig().redrafter_length) == ("auto", "auto")
    assert DecoderConfig(redrafter_length=None).redrafter_length is None  # the head's horizon
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
    import redraft.infer.drafters.redrafter.drafter as rd

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


def test_a_settled_plan_is_rechecked_less_often_and_a_change_replans_sooner(
    tiny_target, tiny_head, tiny_prompts, monkeypatch
):
    """A plan costs ~1 ms of numpy: while it keeps choosing the same (W, L) the steps between two
    plans double up to MAX_REPLAN; a new choice goes back to every REPLAN steps."""
    import redraft.infer.drafters.redrafter.drafter as rd

    choices, planned = iter([(3, 2)] * 5 + [(4, 2)] + [(4, 2)] * 10), []
    dr = ReDrafterDrafter(tiny_head, width="auto", length="auto")

    def plan(*a, **k):
        planned.append(dr._steps)
        return (*next(choices), 1.0)

    monkeypatch.setattr(rd, "plan_beam", plan)
    dec = SpeculativeDecoder(tiny_target, [dr], cost_curve=FLAT)
    ref = plain_greedy(tiny_target, tiny_prompts[:1], max_new_tokens=150)
    out = dec.generate(tiny_prompts[:1], max_new_tokens=150)
    assert [g.tokens for g in out] == [g.tokens for g in ref]
    gaps = np.diff(planned).tolist()
    # plans 1-5 choose (3, 2) (the first changes the default); plan 6 changes to (4, 2)
    assert gaps[:6] == [4, 8, 16, 32, 32, 4][: len(gaps[:6])] and len(gaps) >= 6, planned


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
    assert not ReDrafterDrafter(tiny_head, width=4, length=None).auto
    assert ReDrafterDrafter(tiny_head).auto_width and ReDrafterDrafter(tiny_head).auto_length


def test_depths_past_the_statistics_reuse_the_last_one():
    rates = np.full(((MAX_SPLIT + 1) * 5, 2), 0.5)
    rates[:, 1] = 0.4
    cost = BeamCost.from_ms("1:1", "1:1")
    short = plan_beam(rates, at_zero(3), cost, FLAT, 1, [1, 2, 3], [1, 2, 3, 4])
    full = np.concatenate([rates, rates[:, 1:], rates[:, 1:]], axis=1)
    assert short == plan_beam(full, at_zero(3), cost, FLAT, 1, [1, 2, 3], [1, 2, 3, 4])


def test_auto_groups_beams_by_rank_and_split_depth(tiny_target, tiny_head):
    from redraft.infer.spec.drafter import DecodeState

    H = tiny_target.model.config.hidden_size
    state = DecodeState(
        tokens=torch.tensor([[3, 4], [5, 6]]),
        lengths=torch.tensor([2, 2]),
        last=torch.tensor([4, 6]),
        hidden=torch.randn(2, H),
        prompt_lengths=torch.tensor([1, 1]),
        step=0,
        request_ids=torch.tensor([0, 1]),
    )
    dr = ReDrafterDrafter(tiny_head, width="auto", length=3)
    draft = dr.propose(state)  # no decoder bound: the start width, 8
    toks = draft.tokens.numpy()
    assert toks.shape == (2, 8, 3)
    f = split_depth_np(toks)
    np.testing.assert_array_equal(draft.group.numpy(), beam_group(np.arange(8)[None], f))
    seen = np.zeros((8, MAX_SPLIT + 1))
    for b in range(2):
        seen[np.arange(8), f[b]] += 0.5
    np.testing.assert_allclose(dr.split[:8], 0.9 * at_zero(8) + 0.1 * seen)
    fixed = ReDrafterDrafter(tiny_head, width=8, length=3).propose(state)
    assert fixed.group is None and torch.equal(fixed.tokens, draft.tokens)


def test_the_bench_runs_fixed_and_auto_beams_side_by_side(
    capsys, tiny_target_dir, tiny_head, tmp_path
):
    import json

    from redraft.bench.cli import main

    head = tmp_path / "head"
    tiny_head.save_pretrained(head)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "The quick brown fox jumps over the lazy dog."}))
    out = tmp_path / "r.json"
    argv = ["--target", tiny_target_dir, "--datasets", prompts, "--prompts", 1]
    argv += ["--max-new-tokens", 16, "--methods", "greedy,redrafter,redrafter-auto"]
    argv += ["--drafter", head, "--redrafter-width", 3, "--redrafter-length", 2]
    argv += ["--no-warmup", "--cost-curve", "1:1,8:1.2,64:2", "--out", out]
    code = main([str(a) for a in argv])
    assert code == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    assert res["config"]["decoder"]["redrafter_width"] == 3
    r = res["results"]["p"]
    assert r["redrafter"]["identical_to_ar"] and r["redrafter-auto"]["identical_to_ar"]


def test_the_compiled_plan_and_groups_equal_the_numpy_code(monkeypatch):
    """``hostjit``'s ``plan_beam`` and ``_groups``: the same choice as the numpy code (up to
    float rounding in near-ties: the choice then scores as the best), the same split
    frequencies and groups, bit for bit."""
    from redraft.infer.spec import hostjit

    if hostjit.numba is None:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(4)
    curves = [
        CostCurve([1], [0.02]),
        CostCurve([1, 8, 64, 512], [0.01, 0.012, 0.03, 0.2]),
        CostCurve([1, 4, 16], sorted(rng.uniform(0.001, 0.05, 3))),
    ]
    cost = BeamCost.from_ms("1:2,8:4", "1:1,4:2,16:6,64:20")
    for case in range(60):
        rates = rng.uniform(0.0, 0.9, size=(32, int(rng.integers(1, 17))))
        split = rng.dirichlet(np.ones(MAX_SPLIT + 1), size=16) * (rng.random((16, 1)) < 0.9)
        widths = sorted(rng.choice(range(1, 17), int(rng.integers(1, 8)), replace=False))
        lengths = sorted(rng.choice(range(1, 6), int(rng.integers(1, 5)), replace=False))
        verify, B = curves[case % 3], int(rng.integers(1, 9))
        fixed = float(rng.choice([0.0, 0.004, -0.001]))
        args = (rates, split, cost, verify, B, widths, lengths, fixed)
        monkeypatch.setattr(hostjit, "ENABLED", False)
        want = plan_beam(*args)
        monkeypatch.setattr(hostjit, "ENABLED", True)
        got = plan_beam(*args)
        assert got[2] == pytest.approx(want[2], rel=1e-9)
        monkeypatch.setattr(hostjit, "ENABLED", False)
        got_score = plan_beam(rates, split, cost, verify, B, [got[0]], [got[1]], fixed)[2]
        assert got_score == pytest.approx(want[2], rel=1e-9)  # the kernel's choice is a best one
    head_like = np.array([[[5, 6, 7], [5, 6, 8], [5, 9, 7], [4, 6, 7]]] * 3)
    for tokens in (head_like, rng.integers(0, 3, (5, 8, 4)), rng.integers(0, 2, (1, 16, 6))):
        drafters = []
        for jit in (True, False):
            monkeypatch.setattr(hostjit, "ENABLED", jit)
            d = ReDrafterDrafter.__new__(ReDrafterDrafter)
            d.split = np.zeros((16, MAX_SPLIT + 1))
            d.split[:, 0] = 1
            groups = [d._groups(tokens), d._groups(tokens[::-1].copy())]
            drafters.append((d.split, groups))
        (s1, g1), (s2, g2) = drafters
        np.testing.assert_array_equal(s1, s2)
        for a, b in zip(g1, g2):
            np.testing.assert_array_equal(a, b)
