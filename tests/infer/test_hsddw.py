"""HSDDW: entropy self-verify, early-exit draft models, the M1 -> M2 -> target hierarchy, batched."""

import pytest
import torch

from redraft.infer.config import SamplingParams
from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.hsddw.drafter import (
    CausalLMModel,
    EntropyThreshold,
    HSDDWDrafter,
    ProbModel,
    early_exit_model,
)
from redraft.infer.spec.accept import entropy
from redraft.infer.spec.drafter import Draft, Drafter, Feedback
from redraft.infer.spec.paths import PAD
from redraft.testing import decode_state as _state
from redraft.testing import make_tiny_model


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
    """Next token = (last + 1) % V; the entropy of the i-th distribution computed follows ``script``."""

    def __init__(self, V, script, name="m1"):
        self.V, self.script, self.name = V, script, name
        self.i = 0

    def logits(self, tokens, end, first, rows=None):
        B, K = tokens.shape[0], int((end - first).max())
        out = torch.zeros(B, K, self.V)
        for b in range(B):
            for j in range(int(end[b] - first[b])):
                last = int(tokens[b, first[b] + j])
                out[b, j] = peaked(
                    self.V, (last + 1) % self.V, self.script[min(self.i, len(self.script) - 1)]
                )
                self.i += 1
        return out


class Uncached(ProbModel):
    """Reference draft model: a full forward over each row's context on every call."""

    def __init__(self, model, name):
        self.model, self.name = model, name

    @torch.no_grad()
    def logits(self, tokens, end, first, rows=None):
        B, V = tokens.shape[0], self.model.config.vocab_size
        rows = torch.ones(B, dtype=torch.bool) if rows is None else rows
        out = torch.zeros(B, int(torch.where(rows, end - first, 0).max()), V)
        for b in range(B):
            if rows[b]:
                e, f = int(end[b]), int(first[b])
                out[b, : e - f] = self.model(tokens[b : b + 1, :e]).logits[0, f:e].float()
        return out


class Recorded(HSDDWDrafter):
    """Records every row's chain per request id and step."""

    def propose(self, state):
        dr = super().propose(state)
        if not hasattr(self, "drafts"):
            self.drafts = {}
        for rid, row in zip(state.request_ids.tolist(), dr.tokens[:, 0].tolist()):
            self.drafts.setdefault(rid, []).append([t for t in row if t >= 0])
        return dr


def test_tau_is_the_running_mean_of_rejected_entropies():
    thr = EntropyThreshold(batch_size=2)
    assert thr.tau.tolist() == [0.0, 0.0]
    thr.reject([0], [1.5])
    assert thr.tau.tolist() == [1.5, 0.0]
    thr.reject([0, 1], [0.5, 2.0])
    assert thr.tau.tolist() == [1.0, 2.0]
    thr.reject_where(torch.tensor([True, False]), torch.tensor([4.0, 100.0]))  # row 1 unchanged
    assert thr.tau.tolist() == pytest.approx([2.0, 2.0])
    assert thr.stop(0, 2.01) and not thr.stop(0, 2.0)
    assert thr.exceeds(torch.tensor([2.01, 2.0])).tolist() == [True, False]
    assert thr.exceeds(torch.tensor([[1.0, 3.0], [2.5, 0.0]])).tolist() == [
        [False, True],
        [True, False],
    ]
    thr.select_rows(torch.tensor([1]))
    thr.add_rows(1)
    assert thr.tau.tolist() == [2.0, 0.0]


def test_self_verify_follows_the_rule_on_a_scripted_sequence():
    V = 16
    # entropies of successive M1 steps (one distribution per drafted step)
    script = [1.0, 0.2, 0.1, 3.0, 2.0, 0.5, 0.4, 0.3, 1.2, 9.0]
    m1 = Scripted(V, script)
    d = HSDDWDrafter(m1, max_len=8)
    s = _state([[3, 4]])
    d.add_rows(s, 0)
    # step 1: tau = 0 -> the first token always, then stop at H=0.2 > 0
    dr = d.propose(s)
    assert dr.tokens[0, 0].tolist() == [5]
    # target rejects it: tau = mean(1.0) = 1.0
    d.observe(
        s,
        dr,
        Feedback(
            torch.tensor([[0]]),
            torch.full((1, 1), -1),
            torch.tensor([0]),
            torch.tensor([7]),
            verified=torch.tensor([[1]]),
        ),
    )
    assert d.tau1.tau.item() == pytest.approx(1.0, abs=1e-3)
    # step 2: first token (H=0.1) always, next H=3.0 > 1.0 stops
    m1.i = 2
    dr = d.propose(s)
    assert dr.tokens[0, 0].tolist() == [5]
    d.observe(
        s,
        dr,
        Feedback(
            torch.tensor([[1]]),
            torch.tensor([[5]]),
            torch.tensor([1]),
            torch.tensor([6]),
            verified=torch.tensor([[1]]),
        ),
    )
    assert d.tau1.tau.item() == pytest.approx(1.0, abs=1e-3)  # nothing rejected: tau unchanged
    # step 3: H = 2.0 (first, kept), 0.5, 0.4, 0.3 (<= 1), 1.2 > 1 stops: 4 tokens
    m1.i = 4
    dr = d.propose(s)
    assert dr.tokens[0, 0].tolist() == [5, 6, 7, 8]
    # the target accepts 2: the third token (drafted at H=0.4) is rejected -> tau = (1.0 + 0.4) / 2
    d.observe(
        s,
        dr,
        Feedback(
            torch.tensor([[2]]),
            torch.tensor([[5, 6]]),
            torch.tensor([2]),
            torch.tensor([1]),
            verified=torch.tensor([[4]]),
        ),
    )
    assert d.tau1.tau.item() == pytest.approx(0.7, abs=1e-3)
    # a token the decoder's budget cut is not a rejection, even when the bonus differs
    # (sampling); a verified one is
    m1.i = 4
    dr = d.propose(s)
    d.observe(
        s,
        dr,
        Feedback(
            torch.tensor([[1]]),
            torch.tensor([[5]]),
            torch.tensor([1]),
            torch.tensor([9]),
            verified=torch.tensor([[1]]),
        ),
    )
    assert d.tau1.tau.item() == pytest.approx(0.7, abs=1e-3)
    m1.i = 4
    dr = d.propose(s)
    d.observe(
        s,
        dr,
        Feedback(
            torch.tensor([[1]]),
            torch.tensor([[5]]),
            torch.tensor([1]),
            torch.tensor([6]),
            verified=torch.tensor([[3]]),
        ),
    )  # token 6 (H=0.5) verified, not accepted
    assert d.tau1.tau.item() == pytest.approx((1.0 + 0.4 + 0.5) / 3, abs=1e-3)
    st = d.stats
    assert st.levels["m1"].drafted == 14 and st.levels["m1"].accepted == 5
    assert st.levels["m1"].sigma == pytest.approx(1 - 5 / 14)
    assert st.target_calls == 5 and st.output_tokens == 1 + 2 + 3 + 2 + 2
    assert st.eta == pytest.approx(5 / 10)


def test_self_verify_stops_each_row_at_its_own_tau():
    """Two rows drafting together, one forward per step: each stops by its own tau."""
    V = 16
    m1 = Scripted(V, [0.5])  # every distribution at entropy 0.5
    d = HSDDWDrafter(m1, max_len=5)
    s = _state([[3, 4], [9, 10, 11]])
    d.add_rows(s, 0)
    d.tau1.reject([1], [0.6])  # row 1: tau 0.6 > 0.5 never stops; row 0: tau 0 stops after 1
    dr = d.propose(s)
    assert dr.tokens[:, 0].tolist() == [[5, PAD, PAD, PAD, PAD], [12, 13, 14, 15, 0]]
    assert d.stats.levels["m1"].drafted == 6


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
    """One batched cache, rows of different lengths: each call feeds only what a row's cache
    lacks (one forward for the batch), and a truncated row forgets exactly its dropped tokens."""
    lm = CausalLMModel(early_exit_model(tiny_target.model, 1))
    lm.reset(2)

    def full(row):
        with torch.no_grad():
            return lm.model(torch.tensor([row])).logits[0].float()

    buf = torch.tensor([[3, 8, 21, 4, 9, 11, 12], [7, 7, 30, 2, PAD, PAD, PAD]])
    # row 0: prefill, logits after positions 4..6; row 1: prefill, logits after position 3
    a = lm.logits(buf, torch.tensor([7, 4]), torch.tensor([4, 3]))
    assert (
        a.shape == (2, 3, tiny_target.vocab_size)
        and lm.forwards == 1
        and lm.lengths.tolist() == [7, 4]
    )
    torch.testing.assert_close(a[0], full(buf[0].tolist())[4:7], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a[1, 0], full(buf[1, :4].tolist())[3], rtol=1e-4, atol=1e-4)
    # row 0's last token changes: the drafter truncates, the model feeds the new one only; row 1
    # is not asked and keeps its cache
    buf[0, 6] = 40
    lm.truncate(torch.tensor([6, 100]))
    b = lm.logits(buf, torch.tensor([7, 4]), torch.tensor([6, 3]), rows=torch.tensor([True, False]))
    assert lm.lengths.tolist() == [7, 4]
    torch.testing.assert_close(b[0, 0], full([3, 8, 21, 4, 9, 11, 40])[6], rtol=1e-4, atol=1e-4)
    # row 1 back to a shorter context (cut to `first`), row 0 extends by two tokens
    buf = torch.cat([buf, torch.tensor([[41, 42], [PAD, PAD]])], 1)
    c = lm.logits(buf, torch.tensor([9, 3]), torch.tensor([7, 2]))
    assert lm.lengths.tolist() == [9, 3] and lm.forwards == 3
    torch.testing.assert_close(
        c[0], full([3, 8, 21, 4, 9, 11, 40, 41, 42])[7:9], rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(c[1, 0], full([7, 7, 30])[2], rtol=1e-4, atol=1e-4)
    # rows leave and join
    lm.select_rows(torch.tensor([1]))
    lm.add_rows(1)
    assert lm.lengths.tolist() == [3, 0]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_pre_verify_samples_follow_m2(tiny_target, temperature, top_p):
    """Tokens that pass M2's rejection sampling (or replace a rejected one) are samples of M2's
    distribution at the row's temperature and top-p; greedy rows in the same batch take M2's
    argmax (300 sampled and 20 greedy rows drafting in one batch)."""
    from scipy.stats import chisquare

    from redraft.infer.spec.accept import RowSampling, warp_probs

    V = tiny_target.vocab_size
    m1 = early_exit_model(tiny_target.model, 1)
    m2 = make_tiny_model(V, seed=3)
    with torch.no_grad():
        m2.lm_head.weight.mul_(3.0)  # several tokens with 5-13% each
    d = HSDDWDrafter(m1, m2, max_len=1, m1_max=1)
    ctx = [12, 40, 7]
    n, g = 300, 20
    s = _state([ctx] * (n + g))
    temp = torch.tensor([temperature] * n + [0.0] * g)
    s.sampling = RowSampling(temp, torch.full((n + g,), top_p))
    d.add_rows(s, 0)
    torch.manual_seed(0)
    dr = d.propose(s)
    first, greedy = dr.tokens[:n, 0, 0], dr.tokens[n:, 0, 0]
    with torch.no_grad():
        logits2 = m2(torch.tensor([ctx])).logits[:, -1]
    p2 = warp_probs(logits2, temperature, top_p)[0].double()
    assert greedy.tolist() == [int(logits2.argmax())] * g
    top = p2.topk(6).indices
    obs = torch.stack(
        [(first == t).sum() for t in top] + [(~torch.isin(first, top)).sum()]
    ).double()
    exp = torch.cat([p2[top], (1 - p2[top].sum()).reshape(1)]) * n
    assert exp.min() > 5
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3
    assert d.stats.levels["m1"].drafted == n + g
    assert 0 < d.stats.levels["m1"].accepted < n  # M2 took some of M1's tokens and replaced others


def _eta_from_generations(out):
    """HSDDW's eta from the decoder's own per-request stats: verify steps / tokens they emitted."""
    steps = sum(o.stats.verify_steps for o in out)
    emitted = sum(o.stats.accepted_tokens + o.stats.verify_steps for o in out)
    return steps, emitted


@pytest.mark.parametrize("hierarchy", ["m1", "m1m2"])
def test_hierarchy_greedy_equals_plain_greedy(tiny_target, tiny_prompts, hierarchy):
    m1 = early_exit_model(tiny_target.model, 1)
    m2 = None if hierarchy == "m1" else make_tiny_model(tiny_target.vocab_size, seed=5)
    d = HSDDWDrafter(m1, m2, max_len=6, tau_init=0.5)
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=24)
    out = SpeculativeDecoder(tiny_target, [d], budget=16).generate(tiny_prompts, max_new_tokens=24)
    for r, o in zip(ref, out):
        assert o.tokens == r.tokens
    st = d.stats
    steps, emitted = _eta_from_generations(out)
    assert (st.target_calls, st.output_tokens) == (steps, emitted)
    assert st.eta == pytest.approx(steps / emitted)
    assert st.levels["m1"].drafted > 0
    if hierarchy == "m1":
        assert st.eta < 1.0  # the early exit's tokens were accepted now and then
    else:
        assert st.levels["m2"].drafted > 0


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.3, 0.9)])
def test_rejection_sampling_with_hsddw_keeps_the_target_distribution(
    tiny_target, temperature, top_p
):
    """Decoder + HSDDW sampling: the first token produced by speculative verification (the
    second new token) follows sum_t1 p(t1) p(t2 | prompt, t1) of the warped target, whatever the
    chain sampled. M2 is the target itself, so its chains are accepted now and then (at
    temperature 1 the tiny target is nearly uniform: rarely; at 0.3 often)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    from redraft.infer.spec.accept import warp_probs

    ids = tiny_target.chat_ids([{"role": "user", "content": "Hello"}])
    n, V = 1500, tiny_target.vocab_size
    d = HSDDWDrafter(
        early_exit_model(tiny_target.model, 1), tiny_target.model, max_len=2, m1_max=1, tau_init=6.0
    )
    out = SpeculativeDecoder(tiny_target, [d], acceptance="rejection", budget=4).generate(
        [ids] * n, max_new_tokens=2, temperature=temperature, top_p=top_p, seed=0
    )
    second = torch.tensor([o.tokens[1] for o in out if len(o.tokens) > 1])
    with torch.no_grad():
        p1 = warp_probs(tiny_target.model(torch.tensor([ids])).logits[:, -1], temperature, top_p)[
            0
        ]  # [V]
        p2 = warp_probs(
            tiny_target.model(torch.tensor([ids + [t] for t in range(V)])).logits[:, -1],
            temperature,
            top_p,
        )  # [V, V]
    marg = (p1[:, None] * p2).sum(0).double()
    obs = torch.bincount(second, minlength=V).double()
    exp = marg / marg.sum() * obs.sum()
    keep = exp > 5
    obs_k = torch.cat([obs[keep], obs[~keep].sum()[None]])
    exp_k = torch.cat([exp[keep], exp[~keep].sum()[None]])
    assert scipy_stats.chisquare(obs_k, exp_k / exp_k.sum() * obs_k.sum()).pvalue > 1e-3
    accepted = sum(o.stats.accepted_tokens > 0 for o in out)  # rows that took HSDDW's first token
    assert accepted > (100 if temperature < 1 else 0)
    st = d.stats
    assert st.levels["m1"].drafted > 0 and st.levels["m2"].drafted > 0
    assert (st.target_calls, st.output_tokens) == _eta_from_generations(out)


def test_seeded_sampling_reproduces_the_chains(tiny_target, tiny_prompts):
    """``generate(seed=...)``: HSDDW samples from the rows' generators, so a seed fixes its
    chains and the output; another seed changes them."""
    runs = []
    for seed in (0, 0, 1):
        d = Recorded(
            early_exit_model(tiny_target.model, 1), tiny_target.model, max_len=4, tau_init=6.0
        )
        out = SpeculativeDecoder(tiny_target, [d], acceptance="rejection", budget=8).generate(
            tiny_prompts, max_new_tokens=8, temperature=1.0, seed=seed
        )
        runs.append(([o.tokens for o in out], d.drafts))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def _alone(target, prompts, make, max_new_tokens, **kw):
    """Each prompt decoded on its own: ``(tokens, drafts)`` per prompt."""
    res = []
    for p in prompts:
        d = make()
        out = SpeculativeDecoder(target, [d], budget=16, **kw).generate(
            [p], max_new_tokens=max_new_tokens
        )
        res.append((out[0].tokens, d.drafts[0]))
    return res


@pytest.mark.parametrize("hierarchy", ["m1", "m1m2"])
def test_batched_rows_draft_what_each_row_drafts_alone(tiny_target, tiny_prompts, hierarchy):
    """Greedy: three rows decoded together get, step by step, the chains each gets alone, and
    the chains of draft models with a synced batched cache equal those of uncached models."""
    model = tiny_target.model
    # M2 = the target with tau 6 > ln V: chains of max_len, M1 corrected mid-chain
    m2, tau = (None, 0.5) if hierarchy == "m1" else (model, 6.0)

    def make(cached=True):
        if cached:
            return Recorded(early_exit_model(model, 1), m2, max_len=6, m1_max=2, tau_init=tau)
        ref2 = None if m2 is None else Uncached(m2, "m2")
        return Recorded(
            Uncached(early_exit_model(model, 1), "m1"), ref2, max_len=6, m1_max=2, tau_init=tau
        )

    d = make()
    out = SpeculativeDecoder(tiny_target, [d], budget=16).generate(tiny_prompts, max_new_tokens=16)
    alone = _alone(tiny_target, tiny_prompts, make, 16)
    reference = _alone(tiny_target, tiny_prompts, lambda: make(cached=False), 16)
    for i, o in enumerate(out):
        assert o.tokens == alone[i][0] == reference[i][0]
        assert d.drafts[i] == alone[i][1] == reference[i][1]
    assert (
        sum(len(c) > 1 for c in d.drafts[0]) > 0
    )  # chains longer than the always-drafted first token


class Oracle(Drafter):
    """Proposes the next ``k`` tokens of each request's known greedy output: in a mix it is
    accepted where HSDDW's chain is not, so the committed tokens differ from the chain before
    the bonus position (the draft caches must drop what they drafted there)."""

    name = "oracle"

    def __init__(self, futures, k=3):
        self.futures, self.k = futures, k  # request id -> greedy output

    def propose(self, state):
        toks = torch.full((state.batch_size, 1, self.k), PAD, dtype=torch.long)
        for r in range(state.batch_size):
            fut = self.futures[int(state.request_ids[r])]
            done = int(state.lengths[r] - state.prompt_lengths[r])  # output tokens so far
            nxt = fut[done : done + self.k]
            toks[r, 0, : len(nxt)] = torch.tensor(nxt, dtype=torch.long)
        return Draft(tokens=toks)


def test_tokens_another_drafter_got_accepted_resync_the_draft_caches(tiny_target, tiny_prompts):
    """HSDDW next to a drafter whose paths win: every step the cached draft models give the
    chains of uncached ones (their rows forget the chain tokens the target replaced)."""
    model = tiny_target.model
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=16)
    futures = {i: r.tokens for i, r in enumerate(ref)}
    runs = []
    other = make_tiny_model(tiny_target.vocab_size, seed=5)  # an M2 that is often wrong
    for m1, m2 in (
        (early_exit_model(model, 1), other),
        (Uncached(early_exit_model(model, 1), "m1"), Uncached(other, "m2")),
    ):
        d = Recorded(m1, m2, max_len=6, m1_max=2, tau_init=6.0)
        out = SpeculativeDecoder(tiny_target, [Oracle(futures), d], budget=16).generate(
            tiny_prompts, max_new_tokens=16
        )
        assert [o.tokens for o in out] == [r.tokens for r in ref]
        runs.append(d.drafts)
        # the oracle's path won where HSDDW's chain went wrong
        assert (
            sum(
                o.stats.drafter_accepted["oracle"] - o.stats.drafter_accepted.get("hsddw", 0)
                for o in out
            )
            > 0
        )
    assert runs[0] == runs[1]


def test_rows_joining_mid_batch_draft_as_alone(tiny_target, tiny_prompts):
    """Engine: a row joins while another decodes, a sampled row joins later; the greedy rows get
    the output and the chains they get alone, and finished rows leave the drafter's batch."""
    model = tiny_target.model

    def make():  # M2 = the target with tau 6 > ln V: chains of max_len, M1 corrected mid-chain
        return Recorded(early_exit_model(model, 1), model, max_len=6, m1_max=2, tau_init=6.0)

    dec = SpeculativeDecoder(tiny_target, [make()], acceptance="rejection", budget=16)
    ids = [dec.encode(p)[0] for p in tiny_prompts]
    greedy = SamplingParams.checked(max_new_tokens=16)
    eng = dec.engine()
    done = {}

    def step():
        for ev in eng.step():
            if ev.done:
                done[ev.index] = ev.generation

    a = eng.add(ids[0], greedy)
    for _ in range(3):
        step()
    b = eng.add(ids[1], greedy)
    step()
    c = eng.add(ids[2], SamplingParams.checked(max_new_tokens=8, temperature=1.0, seed=7))
    while eng.has_work:
        step()
    alone = _alone(tiny_target, tiny_prompts[:2], make, 16, acceptance="rejection")
    d = dec.drafters[0]
    for rid, (tokens, drafts) in zip((a, b), alone):
        assert done[rid].tokens == tokens
        assert d.drafts[rid] == drafts
    assert 0 < len(done[c].tokens) <= 8 and d.drafts[c]


def test_reduced_vocab_head_matches_the_full_head_on_its_tokens(tiny_target):
    ee = early_exit_model(tiny_target.model, 1)
    V = tiny_target.vocab_size
    subset = torch.tensor([2, 5, 9, 40, 41, 100, 300])
    full, sub = (
        CausalLMModel(ee, vocab_size=V),
        CausalLMModel(ee, vocab_size=V, vocab_subset=subset),
    )
    full.reset(2)
    sub.reset(2)
    buf = torch.tensor([[3, 8, 21, 9, 40], [7, 2, PAD, PAD, PAD]])
    end, first = torch.tensor([5, 2]), torch.tensor([2, 1])
    a = full.logits(buf, end, first)
    b = sub.logits(buf, end, first)
    torch.testing.assert_close(b[:, :, subset], a[:, :, subset], rtol=1e-5, atol=1e-5)
    out = torch.ones(V, dtype=torch.bool)
    out[subset] = False
    assert torch.isinf(b[:, :, out]).all() and (b[:, :, out] < 0).all()
    assert float(b.softmax(-1)[:, :, subset].sum(-1).min()) == pytest.approx(1.0)


def test_trigram_m1_early_exit_m2_hierarchy_is_exact(tiny_target, tiny_prompts):
    """n-gram -> early exit -> target: M1 costs no forward, M2 checks its chain in one."""
    import numpy as np

    from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
    from redraft.infer.drafters.hsddw.drafter import TrigramModel
    from redraft.ngrams import build_trigram_table, count_trigrams

    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=24)
    V = tiny_target.vocab_size
    table = build_trigram_table(count_trigrams([np.asarray(r.tokens) for r in ref], V))
    tri = TrigramModel(table, tiny_target.vocab_size)
    # the table's distribution after 2 tokens, and after 1 (unknown context: uniform)
    t0 = ref[0].tokens
    lg = tri.logits(torch.tensor([t0[:2], t0[:2]]), torch.tensor([2, 1]), torch.tensor([1, 0]))
    assert int(lg[0, 0].argmax()) == t0[2] and float(lg[0, 0].softmax(-1).max()) > 0.5
    torch.testing.assert_close(lg[1, 0].softmax(-1), torch.full((V,), 1.0 / V))
    d = HSDDWDrafter(
        tri, CausalLMModel(early_exit_model(tiny_target.model, 1), "ee1"), max_len=6, tau_init=2.0
    )
    out = SpeculativeDecoder(tiny_target, [d], budget=16).generate(tiny_prompts, max_new_tokens=24)
    for r, o in zip(ref, out):
        assert o.tokens == r.tokens
    assert d.stats.levels["trigram"].drafted > 0


@pytest.mark.slow
def test_default_target_early_exit_hierarchy_is_exact(default_target):
    """SmolLM2-135M: early-exit(4) -> early-exit(12) -> target, reduced-vocab heads, greedy."""
    from redraft.infer.drafters.hsddw.drafter import default_hierarchy

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
