"""The vLLM proposer's measured step cost and the chain lengths it sends (redraft.vllm.pacing),
without vLLM: a fake clock advances by what a modelled step of the sent size costs."""

import itertools

import numpy as np
import pytest
from vllm_helpers import fake_vllm_config

from redraft.vllm.pacing import KEEP, StepCost, _isotonic, chain_lengths
from redraft.vllm.proposer import Proposer
from redraft.vllm.settings import ProposerSettings


def test_isotonic_pools_the_sizes_that_break_the_order():
    y = np.array([1.0, 3.0, 2.0, 4.0, 3.5, 3.5])
    w = np.array([1.0, 1.0, 3.0, 1.0, 1.0, 2.0])
    out = _isotonic(y, w)
    assert np.allclose(out[:3], [1.0, 2.25, 2.25])  # (3 + 2 * 3) / 4
    assert np.allclose(out[3:], (4.0 + 3.5 + 3.5 * 2) / 4)
    assert np.all(np.diff(out) >= 0)
    assert np.allclose(_isotonic(np.array([1.0, 2.0, 5.0]), np.ones(3)), [1, 2, 5])


def test_step_cost_is_the_median_of_each_size_made_monotone():
    c = StepCost()
    assert c(np.array([4])) is None and c.to_dict() == {}
    for s in (0.010, 0.011, 0.050):  # one slow outlier among three steps of 4 tokens
        c.record(4, s)
    for _ in range(KEEP + 2):
        c.record(8, 0.020)
    c.record(8, 0.090)  # one outlier in the last KEEP steps of 8
    c.record(6, 0.009)  # cheaper than 4 measured: pooled with it
    c.record(0, 1.0)  # not a step
    sizes, sec = c.curve()
    assert sizes.tolist() == [4, 6, 8]
    assert np.allclose(sec[:2], (0.011 * 3 + 0.009) / 4) and np.isclose(sec[2], 0.020)
    n = np.array([2, 4, 7, 8, 20])
    got = c(n)
    assert np.isclose(got[0], sec[0] * 2 / 4)  # below the smallest size: proportional
    assert np.isclose(got[2], (sec[1] + sec[2]) / 2)  # interpolated
    assert np.isclose(got[4], 0.020)  # above the largest: the largest's
    assert c.to_dict()["tokens"] == [4, 6, 8]


def _cost_of(curve):
    c = StepCost()
    for n, s in curve.items():
        c.record(n, s)
    return c


@pytest.mark.parametrize("seed", range(20))
def test_chain_lengths_maximise_the_expected_tokens_per_second(seed):
    """Against every choice of prefixes (brute force) under a measured monotone cost."""
    rng = np.random.default_rng(seed)
    B, k = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    values = np.sort(rng.uniform(0, 1, (B, k)), axis=1)[:, ::-1]  # non-increasing
    values *= rng.uniform(0, 1, (B, k)) > 0.2  # some tokens not to send ...
    values = np.where(np.cumprod(values > 0, axis=1).astype(bool), values, 0.0)  # ... as a cut
    sizes = np.arange(1, B * (k + 1) + 1)
    cost = _cost_of(dict(zip(sizes.tolist(), np.cumsum(rng.uniform(0, 0.02, len(sizes))) + 0.05)))
    got = chain_lengths(values, cost)
    avail = (values > 0).sum(1)
    assert np.all(got <= avail)

    def rate(lengths):
        gain = B + sum(values[b, : lengths[b]].sum() for b in range(B))
        return gain / float(cost(np.array([B + sum(lengths)]))[0])

    best = max(rate(ls) for ls in itertools.product(*[range(a + 1) for a in avail]))
    assert rate(got) == pytest.approx(best)


def test_chain_lengths_send_everything_before_any_step_is_measured():
    values = np.array([[0.9, 0.5, 0.1], [0.2, 0.0, 0.0]])
    assert chain_lengths(values, StepCost()).tolist() == [3, 1]
    flat = _cost_of({n: 0.05 for n in range(1, 9)})
    assert chain_lengths(values, flat).tolist() == [3, 1]
    steep = _cost_of({n: 0.01 * n for n in range(1, 9)})  # every token costs a whole step
    assert chain_lengths(values, steep).tolist() == [0, 0]


def _periodic_run(model_dir, cost_of_step, steps=12, rows=3, k=4, **settings):
    """Decode periodic rows (their context matches are always right) through the proposer; a
    fake clock advances by ``cost_of_step(tokens verified)`` between calls; each row's chain is
    the period's continuation, so vLLM accepts it whole and samples one bonus token."""
    p = Proposer(
        fake_vllm_config(model_dir, k=k),
        ProposerSettings(drafters=["context"], min_value=0.0, **settings),
    )
    now = [0.0]
    p.clock = lambda: now[0]
    period = [[10 + r, 20 + r, 30 + r, 40 + r, 50 + r] for r in range(rows)]
    seqs = [period[r] * 3 for r in range(rows)]
    sent_sizes = []
    out = [[] for _ in range(rows)]
    for step in range(steps):
        sampled = []
        for r in range(rows):
            new = [period[r][(len(seqs[r]) + j) % 5] for j in range(len(out[r]) + 1)]
            if step:
                seqs[r] += new
            sampled.append(new if step else [seqs[r][-1]])
        tok = np.zeros((rows, 256), dtype=np.int32)
        for r in range(rows):
            tok[r, : len(seqs[r])] = seqs[r]
        n = np.array([len(s) for s in seqs], dtype=np.int32)
        out = p.propose(sampled, n, tok)
        tokens = rows + sum(len(c) for c in out)
        sent_sizes.append(tokens)
        now[0] += cost_of_step(tokens)
    return p, sent_sizes


def test_the_proposer_measures_its_steps_and_drafts_where_they_pay(tiny_target_dir, config_env):
    # a step costing the same at any size: every candidate token (after one step without
    # drafts, tried because a smaller step was guessed cheaper than the one measured)
    p, sizes = _periodic_run(tiny_target_dir, lambda n: 0.05)
    assert sizes[:2] == [15, 3] and sizes[2:] == [3 * 5] * (len(sizes) - 2)
    assert set(p.cost.times) == {3, 15} and np.allclose(p.cost.times[15], 0.05)
    # a step costing the same for each token it verifies: no draft pays once measured
    p, sizes = _periodic_run(tiny_target_dir, lambda n: 0.05 * n)
    assert sizes[0] == 15 and sizes[1:] == [3] * (len(sizes) - 1)
    assert np.isclose(p.cost.times[3][-1], 0.15)
    # a fixed part besides: the drafts the learned rates call nearly certain pay again
    p, sizes = _periodic_run(tiny_target_dir, lambda n: 0.2 + 0.05 * n, steps=20)
    assert sizes[1] == 3 and sizes[-1] > 3
    # the floors alone decide: every token
    p, sizes = _periodic_run(tiny_target_dir, lambda n: 0.05 * n, cost="off")
    assert p.cost is None and sizes[1:] == [15] * (len(sizes) - 1)


def test_a_step_with_a_new_request_is_not_measured(tiny_target_dir, config_env):
    p = Proposer(fake_vllm_config(tiny_target_dir, k=4), ProposerSettings(drafters=["context"]))
    now = [0.0]
    p.clock = lambda: now[0]
    row = [10, 11, 12, 13, 14, 20, 21, 10, 11, 12]
    tok = np.zeros((1, 64), dtype=np.int32)
    tok[0, : len(row)] = row
    p.propose([[12]], np.array([len(row)], np.int32), tok)
    now[0] += 1.0  # this step also prefilled another request, which now joins
    other = [7, 8, 9, 30, 31]
    tok2 = np.zeros((2, 64), dtype=np.int32)
    tok2[0, : len(row) + 1], tok2[1, :5] = row + [13], other
    p.propose([[13], [31]], np.array([len(row) + 1, 5], np.int32), tok2)
    assert p.cost.times == {}
