"""HSDDW: entropy self-verify, early-exit draft models, the M1 -> M2 -> target hierarchy."""

import math

import pytest
import torch

from redraft.infer.drafters.base import Feedback
from redraft.infer.drafters.hsddw import (CausalLMModel, EntropyThreshold, HSDDWDrafter, ProbModel,
                                          early_exit_model, entropy)
from redraft.testing import decode_state as _state


def peaked(V, tok, h_target):
    """Logits over V tokens with argmax ``tok`` and entropy close to ``h_target`` (bisection)."""
    lo, hi = 0.0, 50.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lg = torch.zeros(V)
        lg[tok] = mid
        if float(entropy(lg.softmax(-1))) > h_target:
            lo = mid
        else:
            hi = mid
    lg = torch.zeros(V)
    lg[tok] = (lo + hi) / 2
    return lg


class Scripted(ProbModel):
    """Next token = (last + 1) % V; the entropy of step i of every chain follows ``script``."""

    def __init__(self, V, script, name="m1"):
        self.V, self.script, self.name = V, script, name
        self.i = 0

    def logits(self, row, context, extra):
        out = []
        for j in range(len(extra) + 1):
            last = (list(context) + list(extra))[len(context) - 1 + j]
            out.append(peaked(self.V, (last + 1) % self.V, self.script[min(self.i, len(self.script) - 1)]))
            self.i += 1
        return torch.stack(out)


def test_tau_is_the_running_mean_of_rejected_entropies():
    thr = EntropyThreshold(batch_size=2)
    assert thr.tau.tolist() == [0.0, 0.0]
    thr.reject([0], [1.5])
    assert thr.tau.tolist() == [1.5, 0.0]
    thr.reject([0, 1], [0.5, 2.0])
    assert thr.tau.tolist() == [1.0, 2.0]
    thr.reject([0], [4.0])
    assert thr.tau.tolist() == pytest.approx([2.0, 2.0])
    assert thr.stop(0, 2.01) and not thr.stop(0, 2.0)
    thr.select_rows(torch.tensor([1]))
    assert thr.tau.tolist() == [2.0]


def test_self_verify_follows_the_rule_on_a_scripted_sequence():
    V = 16
    # entropies of successive M1 steps (one model call per drafted step)
    script = [1.0, 0.2, 0.1, 3.0, 2.0, 0.5, 0.4, 0.3, 1.2, 9.0]
    m1 = Scripted(V, script)
    d = HSDDWDrafter(m1, max_len=8)
    s = _state([[3, 4]])
    d.add_rows(s, 0)
    # step 1: tau = 0 -> the first token always, then stop at H=0.2 > 0
    dr = d.propose(s)
    assert dr.tokens[0, 0].tolist() == [5]
    # target rejects it: tau = mean(1.0) = 1.0
    d.observe(s, dr, Feedback(torch.tensor([[0]]), torch.full((1, 1), -1), torch.tensor([0]), torch.tensor([7]),
                              verified=torch.tensor([[1]])))
    assert d.tau1.tau.item() == pytest.approx(1.0, abs=1e-3)
    # step 2: first token (H=0.1) always, next H=3.0 > 1.0 stops
    m1.i = 2
    dr = d.propose(s)
    assert dr.tokens[0, 0].tolist() == [5]
    d.observe(s, dr, Feedback(torch.tensor([[1]]), torch.tensor([[5]]), torch.tensor([1]), torch.tensor([6]),
                              verified=torch.tensor([[1]])))
    assert d.tau1.tau.item() == pytest.approx(1.0, abs=1e-3)  # nothing rejected: tau unchanged
    # step 3: H = 2.0 (first, kept), 0.5, 0.4, 0.3 (<= 1), 1.2 > 1 stops: 4 tokens
    m1.i = 4
    dr = d.propose(s)
    assert dr.tokens[0, 0].tolist() == [5, 6, 7, 8]
    # the target accepts 2: the third token (drafted at H=0.4) is rejected -> tau = (1.0 + 0.4) / 2
    d.observe(s, dr, Feedback(torch.tensor([[2]]), torch.tensor([[5, 6]]), torch.tensor([2]), torch.tensor([1]),
                              verified=torch.tensor([[4]])))
    assert d.tau1.tau.item() == pytest.approx(0.7, abs=1e-3)
    # a token the decoder's budget cut is not a rejection, even when the bonus differs
    # (sampling); a verified one is
    m1.i = 4
    dr = d.propose(s)
    d.observe(s, dr, Feedback(torch.tensor([[1]]), torch.tensor([[5]]), torch.tensor([1]), torch.tensor([9]),
                              verified=torch.tensor([[1]])))
    assert d.tau1.tau.item() == pytest.approx(0.7, abs=1e-3)
    m1.i = 4
    dr = d.propose(s)
    d.observe(s, dr, Feedback(torch.tensor([[1]]), torch.tensor([[5]]), torch.tensor([1]), torch.tensor([6]),
                              verified=torch.tensor([[3]])))  # token 6 (H=0.5) verified, not accepted
    assert d.tau1.tau.item() == pytest.approx((1.0 + 0.4 + 0.5) / 3, abs=1e-3)
    st = d.stats
    assert st.levels["m1"].drafted == 14 and st.levels["m1"].accepted == 5
    assert st.levels["m1"].sigma == pytest.approx(1 - 5 / 14)
    assert st.target_calls == 5 and st.output_tokens == 1 + 2 + 3 + 2 + 2
    assert st.eta == pytest.approx(5 / 10)


def test_early_exit_shares_weights_and_matches_its_layers(tiny_target):
    model = tiny_target.model
    n_params = sum(p.numel() for p in model.parameters())
    ee = early_exit_model(model, 1)
    assert len(ee.model.layers) == 1 and len(model.model.layers) == 2  # the target is untouched
    assert ee.config.num_hidden_layers == 1 and model.config.num_hidden_layers == 2
    ptrs = {p.data_ptr() for p in model.parameters()}
    assert all(p.data_ptr() in ptrs for p in ee.parameters())  # no copies
    assert sum(p.numel() for p in model.parameters()) == n_params
    ids = torch.tensor([[5, 9, 33, 2, 17]])
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states[1]  # after the first layer
        ref = model.lm_head(model.model.norm(hs))
        got = ee(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="1..1"):
        early_exit_model(model, 2)


def test_cached_draft_lm_equals_a_full_forward(tiny_target):
    lm = CausalLMModel(early_exit_model(tiny_target.model, 1))
    lm.reset(1)
    ctx = [3, 8, 21, 4, 9]
    a = lm.logits(0, ctx, [11, 12])  # prefill + 2
    b = lm.logits(0, ctx + [11], [40])  # crop back to ctx+[11], feed [11?] no: only the diverging part
    c = lm.logits(0, [3, 8, 21], [])  # a shorter context: crop
    with torch.no_grad():
        full = lm.model(torch.tensor([ctx + [11, 12]])).logits[0].float()
        full2 = lm.model(torch.tensor([ctx + [11, 40]])).logits[0].float()
    torch.testing.assert_close(a, full[4:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b, full2[5:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c[0], full[2], rtol=1e-4, atol=1e-4)


def test_pre_verify_samples_follow_m2(tiny_target):
    """Tokens that pass M2's rejection sampling (or replace a rejected one) are samples of M2's
    distribution: the q handed to the target is right, so target verification stays lossless."""
    from scipy.stats import chisquare

    from redraft.testing import make_tiny_model

    V = tiny_target.vocab_size
    m1 = early_exit_model(tiny_target.model, 1)
    m2 = make_tiny_model(V, seed=3)
    with torch.no_grad():
        m2.lm_head.weight.mul_(3.0)  # several tokens with 5-13% each
    d = HSDDWDrafter(m1, m2, max_len=1, m1_max=1)
    ctx = [12, 40, 7]
    n = 300
    s = _state([ctx] * n, temperature=1.0)
    d.add_rows(s, 0)
    torch.manual_seed(0)
    dr = d.propose(s)
    first = dr.tokens[:, 0, 0]
    with torch.no_grad():
        p2 = m2(torch.tensor([ctx])).logits[0, -1].float().softmax(-1)
    top = p2.topk(6).indices
    obs = torch.stack([(first == t).sum() for t in top] + [(~torch.isin(first, top)).sum()]).double()
    exp = torch.cat([p2[top], (1 - p2[top].sum()).reshape(1)]).double() * n
    assert exp.min() > 5
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3
    assert d.stats.levels["m1"].drafted == n


@pytest.mark.parametrize("hierarchy", ["m1", "m1m2"])
def test_hierarchy_greedy_equals_plain_greedy(tiny_target, tiny_prompts, hierarchy):
    from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
    from redraft.testing import make_tiny_model

    m1 = early_exit_model(tiny_target.model, 1)
    m2 = None if hierarchy == "m1" else make_tiny_model(tiny_target.vocab_size, seed=5)
    d = HSDDWDrafter(m1, m2, max_len=6, tau_init=0.5)
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=24)
    out = SpeculativeDecoder(tiny_target, [d], budget=16).generate(tiny_prompts, max_new_tokens=24)
    for r, o in zip(ref, out):
        assert o.tokens == r.tokens
    st = d.stats
    assert st.target_calls > 0 and 0 < st.eta <= 1
    assert st.levels["m1"].drafted > 0


def test_hierarchy_sampling_runs_with_rejection(tiny_target, tiny_prompts):
    from redraft.infer.decoder import SpeculativeDecoder

    d = HSDDWDrafter(early_exit_model(tiny_target.model, 1), tiny_target.model, max_len=4, tau_init=1.0)
    out = SpeculativeDecoder(tiny_target, [d], acceptance="rejection", budget=8).generate(
        tiny_prompts, max_new_tokens=20, temperature=1.0, seed=0)
    assert all(0 < len(o.tokens) <= 20 for o in out)
    # M2 (the target itself here) pre-verified M1's sampled tokens, and the chains reached the target
    st = d.stats
    assert st.levels["m1"].drafted > 0 and st.levels["m2"].drafted > 0
    assert st.target_calls > 0 and 0 < st.eta <= 1.0


def test_reduced_vocab_head_matches_the_full_head_on_its_tokens(tiny_target):
    ee = early_exit_model(tiny_target.model, 1)
    subset = torch.tensor([2, 5, 9, 40, 41, 100, 300])
    full, sub = CausalLMModel(ee, vocab_size=tiny_target.vocab_size), CausalLMModel(ee, vocab_size=tiny_target.vocab_size, vocab_subset=subset)
    full.reset(1)
    sub.reset(1)
    a = full.logits(0, [3, 8, 21], [9, 40])
    b = sub.logits(0, [3, 8, 21], [9, 40])
    torch.testing.assert_close(b[:, subset], a[:, subset], rtol=1e-5, atol=1e-5)
    out = torch.ones(tiny_target.vocab_size, dtype=torch.bool)
    out[subset] = False
    assert torch.isinf(b[:, out]).all() and (b[:, out] < 0).all()
    assert float(b.softmax(-1)[:, subset].sum(-1).min()) == pytest.approx(1.0)


def test_trigram_m1_early_exit_m2_hierarchy_is_exact(tiny_target, tiny_prompts):
    """n-gram -> early exit -> target: M1 costs no forward, M2 checks its chain in one."""
    import numpy as np

    from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
    from redraft.infer.drafters.hsddw import TrigramModel
    from redraft.ngrams import build_trigram_table, count_trigrams

    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=24)
    V = tiny_target.vocab_size
    table = build_trigram_table(count_trigrams([np.asarray(r.tokens) for r in ref], V))
    tri = TrigramModel(table, tiny_target.vocab_size)
    lg = tri.logits(0, list(ref[0].tokens[:2]), [])  # the table's distribution after 2 tokens
    assert int(lg[0].argmax()) == ref[0].tokens[2] and float(lg[0].softmax(-1).max()) > 0.5
    d = HSDDWDrafter(tri, CausalLMModel(early_exit_model(tiny_target.model, 1), "ee1"), max_len=6, tau_init=2.0)
    out = SpeculativeDecoder(tiny_target, [d], budget=16).generate(tiny_prompts, max_new_tokens=24)
    for r, o in zip(ref, out):
        assert o.tokens == r.tokens
    assert d.stats.levels["trigram"].drafted > 0


@pytest.mark.slow
def test_default_target_early_exit_hierarchy_is_exact(default_target):
    """SmolLM2-135M: early-exit(4) -> early-exit(12) -> target, reduced-vocab heads, greedy."""
    from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
    from redraft.infer.drafters.hsddw import default_hierarchy

    prompts = [[{"role": "user", "content": "List three primary colors."}], "def fibonacci(n):"]
    subset = torch.arange(8192)  # low ids: the BPE merges learnt first, the most frequent tokens
    d = default_hierarchy(default_target, 4, 12, vocab_subset=subset, tau_init=1.0)
    ref = plain_greedy(default_target, prompts, max_new_tokens=16)
    out = SpeculativeDecoder(default_target, [d], budget=8).generate(prompts, max_new_tokens=16)
    for r, o in zip(ref, out):
        assert o.tokens == r.tokens
    st = d.stats.to_dict()
    assert st["levels"]["ee12"]["accepted"] > 0  # the target accepted some of M2's tokens
    assert st["eta"] < 1.0
