"""The decoder on tiny models: greedy output equals plain greedy for every drafter and the mix,
batches with different accepted lengths, streaming, stop strings, sampling, stats."""

import numpy as np
import pytest
import torch

from redraft.errors import ConfigError
from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.ngram import ContextNGramDrafter, NGrammysDrafter, TableDrafter
from redraft.infer.drafters.redrafter.drafter import ReDrafterDrafter
from redraft.infer.runner.cost import BatchCost, CostCurve
from redraft.infer.spec.drafter import DecodeState, Draft, Drafter
from redraft.infer.spec.gate import DrafterGate, SpeculationGuard
from redraft.infer.spec.hoststats import best_budget_np


def hf_greedy(target, ids, n):
    out = target.model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=target.eos_token_ids,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


class OracleDrafter(Drafter):
    """Proposes the target's own greedy continuation (known in advance) with some paths cut,
    so rows accept different numbers of tokens; and a wrong sibling path."""

    name = "oracle"

    def __init__(self, futures, L=3):
        self.futures, self.L = futures, L  # request id -> full greedy token list

    def propose(self, state: DecodeState) -> Draft:
        B = state.batch_size
        out = torch.full((B, 2, self.L), -1, dtype=torch.long)
        for r in range(B):
            fut = self.futures[int(state.request_ids[r])]
            done = int(state.lengths[r] - state.prompt_lengths[r])  # tokens emitted so far
            good = fut[done : done + 1 + (int(state.step) + r) % self.L]
            out[r, 0, : len(good)] = torch.tensor(good)
            out[r, 1, 0] = (fut[done] + 1) % 300 if done < len(fut) else 1
        return Draft(tokens=out)


def all_drafter_sets(target, tables, head):
    V = target.vocab_size
    return {
        "context": [ContextNGramDrafter(V)],
        "context-q2": [ContextNGramDrafter(V, q=2, k=4, w=6)],
        "bigram": [TableDrafter(tables, "bigram")],
        "extended": [TableDrafter(tables, "extended")],
        "unigram": [TableDrafter(tables, "unigram")],
        "ngrammys": [NGrammysDrafter(tables, V)],
        "redrafter": [ReDrafterDrafter(head, width=4, length=3)],
        "mix": [
            NGrammysDrafter(tables, V),
            ReDrafterDrafter(head, width=4, length=3),
            ContextNGramDrafter(V, q=2, k=4, w=6, name="context2"),
        ],
    }


@pytest.mark.parametrize("budget", ["auto", 12])
def test_greedy_equals_plain_greedy_for_every_drafter(
    tiny_target, tiny_tables, tiny_head, tiny_prompts, budget
):
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=32)
    dec = SpeculativeDecoder(tiny_target, [])
    for r, p in zip(ref, tiny_prompts):  # our plain greedy is transformers' greedy
        ids = dec.encode(p)[0]
        assert r.tokens == hf_greedy(tiny_target, ids, 32)[: len(r.tokens)]
    curve = CostCurve([1, 8, 64], [1.0, 1.2, 2.0])  # a fixed curve keeps the test deterministic
    for name, drafters in all_drafter_sets(tiny_target, tiny_tables, tiny_head).items():
        dec = SpeculativeDecoder(tiny_target, drafters, budget=budget, cost_curve=curve)
        out = dec.generate(tiny_prompts, max_new_tokens=32)
        for o, r in zip(out, ref):
            assert o.tokens == r.tokens, name
            assert o.text == r.text
            assert o.stats.new_tokens == len(o.tokens)
            assert o.stats.target_calls <= r.stats.target_calls


def test_batch_rows_with_different_accepted_lengths(tiny_target, tiny_prompts):
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=24)
    futures = {i: r.tokens for i, r in enumerate(ref)}
    dec = SpeculativeDecoder(tiny_target, [OracleDrafter(futures)], budget=8)
    out = dec.generate(tiny_prompts, max_new_tokens=24)
    hists = [o.stats.accepted_hist for o in out]
    for o, r in zip(out, ref):
        assert o.tokens == r.tokens
        assert o.stats.drafter_accepted["oracle"] == sum(
            k * v for k, v in o.stats.accepted_hist.items()
        )
    assert any(len(h) > 1 for h in hists)  # rows accepted 0, 1, 2 and 3 tokens in different steps
    assert all(o.stats.tokens_per_call > 1.5 for o in out)


def test_single_prompt_forms_and_token_ids(tiny_target):
    dec = SpeculativeDecoder(tiny_target, [ContextNGramDrafter(tiny_target.vocab_size)])
    chat = [{"role": "user", "content": "Hello there"}]
    ids = tiny_target.chat_ids(chat)
    a = dec.generate(chat, max_new_tokens=10)[0]
    b = dec.generate(ids, max_new_tokens=10)[0]
    c = dec.generate(torch.tensor(ids), max_new_tokens=10)[0]
    assert a.tokens == b.tokens == c.tokens
    assert len(a.tokens) == 10 and a.finish_reason == "length"
    with pytest.raises(ConfigError):
        dec.generate([[]], max_new_tokens=4)
    with pytest.raises(ConfigError):
        dec.generate("hi", temperature=1.0)  # greedy acceptance cannot sample


def test_streaming_concatenates_to_the_final_text(tiny_target, tiny_tables, tiny_prompts):
    dec = SpeculativeDecoder(tiny_target, [NGrammysDrafter(tiny_tables, tiny_target.vocab_size)])
    final = dec.generate(tiny_prompts, max_new_tokens=30)
    pieces = {i: "" for i in range(len(tiny_prompts))}
    toks = {i: [] for i in range(len(tiny_prompts))}
    done = set()
    for ev in dec.generate(tiny_prompts, max_new_tokens=30, stream=True):
        assert ev.index not in done
        pieces[ev.index] += ev.text
        toks[ev.index] += ev.tokens
        if ev.done:
            done.add(ev.index)
    assert done == set(range(len(tiny_prompts)))
    for i, g in enumerate(final):
        assert pieces[i] == g.text
        assert toks[i] == g.tokens


def test_stop_strings_cut_the_text(tiny_target, tiny_prompts):
    ref = plain_greedy(tiny_target, tiny_prompts[:1], max_new_tokens=30)[0]
    text = ref.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop and stop in text
    dec = SpeculativeDecoder(tiny_target, [ContextNGramDrafter(tiny_target.vocab_size)])
    g = dec.generate(tiny_prompts[:1], max_new_tokens=30, stop=[stop])[0]
    assert g.finish_reason == "stop"
    assert g.text == text[: text.index(stop)]


def test_eos_ends_a_row_even_inside_an_accepted_draft(tiny_target, tiny_prompts):
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=30)
    stop_tok = ref[1].tokens[7]  # pretend this token is an end-of-sequence id
    futures = {i: r.tokens for i, r in enumerate(ref)}
    ar = SpeculativeDecoder(tiny_target, [])
    sd = SpeculativeDecoder(tiny_target, [OracleDrafter(futures, L=4)], budget=8)
    ar.eos = sd.eos = {stop_tok}
    a = ar.generate(tiny_prompts, max_new_tokens=30)
    b = sd.generate(tiny_prompts, max_new_tokens=30)
    assert [x.tokens for x in a] == [x.tokens for x in b]
    first = ref[1].tokens.index(stop_tok)
    assert b[1].tokens == ref[1].tokens[: first + 1] and b[1].finish_reason == "eos"
    for x, r in zip(b, ref):  # other rows stop at their own first occurrence, or run to the end
        if stop_tok in r.tokens:
            assert x.tokens == r.tokens[: r.tokens.index(stop_tok) + 1]
        else:
            assert x.tokens == r.tokens and x.finish_reason == "length"


def test_sampling_is_reproducible_and_uses_the_drafts(tiny_target, tiny_tables, tiny_prompts):
    def fresh():  # the tree adapts across requests and to measured timings ("auto" budget), so a
        # seed reproduces a sample for a fresh decoder with a fixed budget
        return SpeculativeDecoder(
            tiny_target, [TableDrafter(tiny_tables, "extended")], acceptance="rejection", budget=8
        )

    a = fresh().generate(tiny_prompts, max_new_tokens=20, temperature=0.8, seed=1)
    b = fresh().generate(tiny_prompts, max_new_tokens=20, temperature=0.8, seed=1)
    assert [x.tokens for x in a] == [x.tokens for x in b]
    assert sum(x.stats.drafter_accepted["extended"] for x in a) > 0


def test_rejection_sampling_end_to_end_keeps_the_first_speculative_token_distribution(
    tiny_target, tiny_tables
):
    """Batch of identical prompts = many seeds. The second new token is the first one produced
    by speculative verification; its marginal must match sum_t1 p(t1) p(t2 | prompt, t1)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    ids = tiny_target.chat_ids([{"role": "user", "content": "Hello"}])
    n, V = 1500, tiny_target.vocab_size
    dec = SpeculativeDecoder(
        tiny_target, [TableDrafter(tiny_tables, "bigram", k=4)], acceptance="rejection", budget=4
    )
    out = dec.generate([ids] * n, max_new_tokens=2, temperature=1.0, seed=0)
    second = torch.tensor([o.tokens[1] for o in out if len(o.tokens) > 1])
    with torch.no_grad():
        p1 = tiny_target.model(torch.tensor([ids])).logits[0, -1].softmax(-1)  # [V]
        batch = torch.tensor([ids + [t] for t in range(V)])
        p2 = tiny_target.model(batch).logits[:, -1].softmax(-1)  # [V, V]
    marg = (p1[:, None] * p2).sum(0).double()
    obs = torch.bincount(second, minlength=V).double()
    exp = marg / marg.sum() * obs.sum()
    keep = exp > 5
    obs_k = torch.cat([obs[keep], obs[~keep].sum()[None]])
    exp_k = torch.cat([exp[keep], exp[~keep].sum()[None]])
    assert scipy_stats.chisquare(obs_k, exp_k / exp_k.sum() * obs_k.sum()).pvalue > 1e-3
    assert sum(o.stats.accepted_hist.get(1, 0) for o in out) > 30  # drafts were accepted


def test_drafters_observe_what_was_accepted(tiny_target, tiny_prompts):
    ref = plain_greedy(tiny_target, tiny_prompts[:1], max_new_tokens=12)[0]

    class Recorder(OracleDrafter):
        def add_rows(self, state, start):
            assert start == 0 and state.batch_size == 1
            self.seen = []

        def observe(self, state, draft, feedback):
            self.seen.append(
                (
                    draft.tokens.clone(),
                    feedback.accepted_prefix.clone(),
                    feedback.num_accepted.clone(),
                    feedback.bonus.clone(),
                )
            )

    rec = Recorder({0: ref.tokens})
    SpeculativeDecoder(tiny_target, [rec], budget=8).generate(tiny_prompts[:1], max_new_tokens=12)
    assert rec.seen
    for toks, prefix, num, _bonus in rec.seen:
        # the oracle path is accepted whole, the wrong sibling not at all
        assert int(prefix[0, 0]) == int((toks[0, 0] >= 0).sum())
        assert int(prefix[0, 1]) == 0
        assert int(num[0]) == int(prefix[0, 0])


class SlowWrongDrafter(Drafter):
    """Costs time every call and never proposes an accepted token."""

    name = "slow-wrong"

    def __init__(self, delay=0.02):
        self.delay, self.calls = delay, 0

    def propose(self, state: DecodeState) -> Draft:
        import time

        self.calls += 1
        time.sleep(self.delay)
        # token 0 (a special token) is never the tiny target's greedy choice after a prompt
        return Draft(tokens=torch.zeros((state.batch_size, 1, 2), dtype=torch.long))


def test_gating_stops_calling_a_costly_useless_drafter_and_keeps_the_output(
    tiny_target, tiny_prompts
):
    prompt = tiny_prompts[1]
    ref = plain_greedy(tiny_target, prompt, max_new_tokens=48)[0].tokens
    # the oracle proposes the target's own continuation: accepted, and cheap
    futures = {0: hf_greedy(tiny_target, SpeculativeDecoder(tiny_target).encode(prompt)[0], 60)}
    curve = CostCurve(sizes=[1, 8, 64], seconds=[0.001, 0.0012, 0.002])
    for gate, explore in ((True, 8), (False, 8)):
        slow = SlowWrongDrafter()
        dec = SpeculativeDecoder(
            tiny_target,
            [OracleDrafter(futures), slow],
            cost_curve=curve,
            gate=gate,
            gate_explore=explore,
        )
        out = dec.generate(prompt, max_new_tokens=48)[0]
        assert out.tokens == ref
        steps = out.stats.target_calls - 1
        st = out.stats  # the gate's view, as redraft-bench reports it
        assert st.drafter_calls["slow-wrong"] == slow.calls
        assert st.drafter_exclusive["slow-wrong"] == 0  # it never proposes an accepted token
        if not gate:  # side by side every step: every accepted token is the oracle's alone
            assert st.drafter_calls["oracle"] == st.joint_steps == steps
            assert st.drafter_exclusive["oracle"] == st.accepted_tokens > 0
        if gate:
            # called on the first steps (no estimate yet), then about once every `explore` steps
            assert slow.calls <= 2 + steps // explore + 1 < steps
            assert dec.gate.gain[1] == 0.0 and dec.gate.gain[0] > 0
        else:
            assert slow.calls == steps


def test_gating_backs_off_from_a_drafter_that_stays_useless():
    gate = DrafterGate(2, explore=8)
    for _ in range(2):  # (the first call is setup, not timed)
        gate.record_time(0, 0.0)
        gate.record_time(1, 0.005)
    gate.update(
        step_secs=0.01, tokens_per_row=1.0, exclusive={0: 1.0, 1: 0.0}
    )  # 0 pays, 1 never does
    assert gate.net(0) > 0 > gate.net(1)
    runs = [t for t in range(300) if 1 in gate.active()]
    # re-runs after waits of 8, 16, 32, 64, then every 128 steps (MAX_WAIT_FACTOR x explore)
    assert runs == [7, 23, 55, 119, 247]
    gate.update(step_secs=0.01, tokens_per_row=1.0, exclusive={1: 10.0})  # it pays again
    assert all(1 in gate.active() for _ in range(3)) and gate.wait[1] == 8


def test_gate_calls_every_drafter_until_it_knows_the_cost_of_a_token():
    gate = DrafterGate(3, explore=4)
    assert gate.active() == [0, 1, 2]
    gate.update(step_secs=0.01, tokens_per_row=2.0, exclusive={0: 0.0, 1: 0.0, 2: 0.0})
    for i, secs in enumerate((0.001, 0.002, 0.003)):
        gate.record_time(i, secs)
        gate.record_time(i, secs)
    # nobody pays: the one that loses least is called, the others wait
    assert gate.active() == [0]
    assert DrafterGate(3, enabled=False).active() == [0, 1, 2]


def test_gate_keeps_calling_a_drafter_that_costs_under_one_percent_of_a_token():
    gate = DrafterGate(3, explore=4)
    gate.update(step_secs=0.1, tokens_per_row=2.0, exclusive={0: 0.0, 1: 0.0, 2: 1.0})
    # a token costs 50 ms: 0.4 ms of drafting is free, 0.6 ms with no exclusive gain is not
    for i, secs in enumerate((0.0004, 0.0006, 0.002)):
        gate.record_time(i, secs)
        gate.record_time(i, secs)
    assert gate.active() == [0, 2]
    assert [0 in gate.active() for _ in range(20)] == [True] * 20


def test_gate_does_not_take_a_drafters_first_call_setup_for_its_cost():
    gate = DrafterGate(2, explore=8)
    # the first call builds tables (8 ms), later ones take 0.03 ms; a token costs 30 ms, and the
    # drafter's tokens are all shared with the other drafter (no exclusive gain)
    gate.record_time(0, 0.008)
    gate.record_time(1, 0.0002)
    gate.update(step_secs=0.06, tokens_per_row=2.0, exclusive={0: 0.0, 1: 1.0})
    called = []
    for _ in range(20):
        act = gate.active()
        called.append(0 in act)
        for i in act:
            gate.record_time(i, 0.00003 if i == 0 else 0.0002)
        gate.update(0.06, 2.0, {i: float(i) for i in act})
    assert called == [True] * 20  # under 1% of a token: always called
    assert gate.secs[0] == pytest.approx(0.00003)


def test_gate_keeps_a_cheap_drafter_through_one_slow_call():
    gate = DrafterGate(2, explore=8)
    gate.update(step_secs=0.06, tokens_per_row=2.0, exclusive={0: 0.02, 1: 1.0})
    for t in (0.0001, 0.0001, 0.0001, 0.0001, 0.02, 0.0001):  # one call preempted: 20 ms
        gate.record_time(0, t)
        assert 0 in gate.active()
    assert gate.secs[0] == pytest.approx(0.0001)
    for _ in range(3):  # slower for good: the median follows
        gate.record_time(0, 0.02)
    assert gate.secs[0] == pytest.approx(0.02) and 0 not in gate.active()


def _drive(guard, batch, tps, steps):
    """Run ``steps`` steps at ``batch`` where a speculative step yields tps[True] tokens per
    second and a plain one tps[False]; returns the modes chosen."""
    modes = []
    for _ in range(steps):
        spec = guard.speculate(batch)
        modes.append(spec)
        guard.record(batch, spec, tokens=int(tps[spec] * 10), seconds=10.0)
    return modes


def test_guard_measures_both_modes_then_runs_the_faster():
    R = SpeculationGuard.RUN
    g = SpeculationGuard(explore=4)
    modes = _drive(g, 8, {True: 100.0, False: 300.0}, 2 * R + 4)
    # a speculative run, a plain run to compare, then plain (speculation lost)
    assert (
        modes[:R] == [True] * R
        and modes[R : 2 * R] == [False] * R
        and modes[2 * R :] == [False] * 4
    )
    g = SpeculationGuard(explore=4)
    modes = _drive(g, 8, {True: 300.0, False: 100.0}, 2 * R + SpeculationGuard.REPROBE + 1)
    assert modes[2 * R : 2 * R + SpeculationGuard.REPROBE] == [True] * SpeculationGuard.REPROBE
    assert modes[-1] is False  # after a long stretch, a short plain probe re-checks


def test_guard_backs_off_from_losing_speculation_and_comes_back_when_it_pays():
    R, explore = SpeculationGuard.RUN, 4
    g = SpeculationGuard(explore=explore)
    modes = _drive(g, 4, {True: 100.0, False: 300.0}, 2 * R + 200)
    tries = [i for i in range(2 * R, len(modes)) if modes[i] and not modes[i - 1]]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # waits grow while it keeps losing
    assert max(gaps) <= SpeculationGuard.MAX_WAIT_FACTOR * explore + R
    modes = _drive(g, 4, {True: 500.0, False: 300.0}, 300)  # the batch's drafts got better
    assert sum(modes[-150:]) > 140


def test_guard_ignores_single_rows_the_first_step_of_a_run_and_other_buckets():
    g = SpeculationGuard()
    assert all(_drive(g, 1, {True: 1.0, False: 1e9}, 50))  # one row: the cost curve's own case
    assert all(_drive(SpeculationGuard(enabled=False), 8, {True: 1.0, False: 1e9}, 50))
    R = SpeculationGuard.RUN
    g = SpeculationGuard()
    for i in range(2 * R):  # first step of each run is very slow (a warm-up); the rest win
        spec = g.speculate(8)
        g.record(8, spec, tokens=1000 if spec else 100, seconds=1e6 if i % R == 0 else 1.0)
    assert g.speculate(8) is True
    assert _drive(g, 16, {True: 1.0, False: 2.0}, R)[0] is True  # 16 is another bucket than 8


def test_a_new_guard_bucket_starts_from_its_neighbours_verdicts():
    R, explore = SpeculationGuard.RUN, 4
    g = SpeculationGuard(explore=explore)
    _drive(g, 4, {True: 100.0, False: 300.0}, 2 * R + 1)  # speculation lost at batch 4-7
    modes = _drive(g, 8, {True: 100.0, False: 300.0}, explore + R)
    assert modes[:explore] == [False] * explore  # batch 8-15 starts plain, no losing run first
    assert modes[explore:] == [True] * R  # then one speculative run re-checks it
    g = SpeculationGuard(explore=explore)
    _drive(g, 16, {True: 300.0, False: 100.0}, 2 * R + 1)  # speculation won at batch 16-31
    assert (
        _drive(g, 8, {True: 300.0, False: 100.0}, SpeculationGuard.REPROBE)
        == [True] * SpeculationGuard.REPROBE
    )
    g = SpeculationGuard(explore=explore)
    _drive(
        g, 16, {True: 100.0, False: 300.0}, 2 * R + 1
    )  # a loss at a larger batch says nothing of 8
    assert _drive(g, 8, {True: 300.0, False: 100.0}, R) == [True] * R


def test_guard_plain_steps_keep_the_output_and_call_no_drafter(
    tiny_target, tiny_tables, tiny_prompts
):
    V = tiny_target.vocab_size
    calls = []

    class Counting(NGrammysDrafter):
        def propose(self, state):
            calls.append(state.batch_size)
            return super().propose(state)

    dec = SpeculativeDecoder(tiny_target, [Counting(tiny_tables, V)], cost_curve=CostCurve.flat())
    dec.guard.speculate = lambda batch: False  # every step plain
    out = dec.generate(tiny_prompts[:3], max_new_tokens=12)
    ref = plain_greedy(tiny_target, tiny_prompts[:3], max_new_tokens=12)
    assert [g.tokens for g in out] == [g.tokens for g in ref]
    assert calls == [] and [g.stats.target_calls for g in out] == [
        g.stats.target_calls for g in ref
    ]


def test_the_same_seed_gives_the_same_text_on_one_decoder_and_with_any_drafts(
    tiny_target, tiny_tables, tiny_prompts
):
    """A seed is the request's own (per-token uniforms), so a decoder that adapts its
    tree between calls (auto budget, rates, gate, guard) repeats itself, and equals plain sampling
    with no drafter at all."""
    V = tiny_target.vocab_size
    dec = SpeculativeDecoder(
        tiny_target,
        [NGrammysDrafter(tiny_tables, V), TableDrafter(tiny_tables, "bigram")],
        acceptance="rejection",
        cost_curve=CostCurve.flat(),
    )
    runs = [
        [
            g.tokens
            for g in dec.generate(
                tiny_prompts, max_new_tokens=24, temperature=0.8, top_p=0.95, seed=0
            )
        ]
        for _ in range(4)
    ]
    assert all(r == runs[0] for r in runs)
    plain = SpeculativeDecoder(tiny_target, [], acceptance="rejection", budget=0)
    assert [
        g.tokens
        for g in plain.generate(
            tiny_prompts, max_new_tokens=24, temperature=0.8, top_p=0.95, seed=0
        )
    ] == runs[0]
    other = [
        g.tokens
        for g in dec.generate(tiny_prompts, max_new_tokens=24, temperature=0.8, top_p=0.95, seed=1)
    ]
    assert other != runs[0]


def test_a_bucket_the_cost_model_says_loses_starts_plain_then_checks():
    R, explore = SpeculationGuard.RUN, 4
    g = SpeculationGuard(explore=explore)
    g.prior = lambda batch: batch < 8  # the cost model: speculation pays below 8 rows
    wait = SpeculationGuard.PRIOR_WAIT * explore
    modes = _drive(g, 8, {True: 300.0, False: 100.0}, wait + R + 1)
    # predicted to lose: a plain stretch first, then a speculative run checks the prediction
    assert modes[:wait] == [False] * wait and modes[wait : wait + R] == [True] * R
    g = SpeculationGuard(explore=explore)
    g.prior = lambda batch: batch < 8
    assert _drive(g, 4, {True: 300.0, False: 100.0}, R) == [True] * R  # predicted to pay


def test_batch_cost_interpolates_between_measured_batch_sizes():
    one = CostCurve([1, 16], [0.010, 0.020])
    two = CostCurve([1, 16], [0.012, 0.040])
    eight = CostCurve([1, 16], [0.020, 0.160])
    bc = BatchCost({1: one, 2: two, 8: eight})
    assert bc(2, 16) == pytest.approx(0.040)
    assert bc(5, 16) == pytest.approx(0.040 + 0.5 * 0.120)  # halfway from 2 to 8 rows
    assert bc(16, 1) == pytest.approx(0.040)  # past the largest: in proportion to the rows
    # the budget reads a batch off it: steep batched costs give a smaller tree than c(B * n)
    values = np.tile(0.8 ** np.arange(1, 16), (4, 1))  # a chain's node values
    flat = CostCurve([1, 64], [0.010, 0.011])
    assert best_budget_np(values, flat, 15) == 15
    assert best_budget_np(values, flat, 15, batch_cost=bc) < 15


def test_the_decoder_measures_batched_costs_and_predicts_per_batch(tiny_target):
    dec = SpeculativeDecoder(
        tiny_target, [ContextNGramDrafter(tiny_target.vocab_size)], max_nodes=8
    )
    bc = dec.measure_batch_cost(4, context=16)
    assert bc.batches == [1, 2, 4] and dec.cost_curve is bc.curves[1]
    assert all(float(bc(b, 4)) > 0 for b in (1, 2, 4))
    assert dec.speculator._speculation_pays(4) is None  # no node values yet
    dec.speculator._last_values = np.full((2, 8), 0.9)
    dec.batch_cost = BatchCost({1: CostCurve([1, 16], [1.0, 1.1])})  # nearly flat: pays
    assert dec.speculator._speculation_pays(4) is True
    dec.batch_cost = BatchCost({1: CostCurve([1, 2, 16], [1.0, 2.0, 16.0])})  # each token a step
    assert dec.speculator._speculation_pays(4) is False


@pytest.mark.parametrize("measured", [False, True])
def test_without_batched_costs_a_batch_tree_stays_within_the_curves_sizes(
    tiny_target, monkeypatch, measured
):
    """A flat one-row curve measured to 16 tokens: 4 rows get at most 16 // 4 - 1 = 3 nodes a
    row (past 16 tokens the curve is a guess); with batched costs the budget alone decides."""
    import redraft.infer.spec.speculator as spec_mod

    V = tiny_target.vocab_size
    flat = CostCurve([1, 16], [1.0, 1.001])
    dec = SpeculativeDecoder(tiny_target, [ContextNGramDrafter(V)], cost_curve=flat, max_nodes=8)
    if measured:
        dec.batch_cost = BatchCost({1: flat, 4: flat})
    calls, best = [], spec_mod.best_budget_np

    def spy(values, cost, max_nodes, *a):
        k = best(values, cost, max_nodes, *a)
        calls.append((values.shape[0], max_nodes, k))
        return k

    monkeypatch.setattr(spec_mod, "best_budget_np", spy)
    prompts = [[(i + j % 5) % V for j in range(40)] for i in range(4)]  # repeats: drafts
    out = dec.generate(prompts, max_new_tokens=24)
    assert [g.tokens for g in out] == [r.tokens for r in plain_greedy(tiny_target, prompts, 24)]
    at4 = [(m, k) for b, m, k in calls if b == 4]
    assert at4
    if measured:
        assert all(m == 8 for m, _ in at4) and max(k for _, k in at4) > 3
    else:
        assert all(m == 3 for m, _ in at4) and max(k for _, k in at4) == 3


def test_one_slow_drafting_step_does_not_stay_in_the_budgets_price(tiny_target, tiny_prompts):
    """The first speculative step may compile the host kernels (seconds): the budget adds the
    median of the recent drafting times to a step's cost, so it is gone after a few steps."""
    import time as _time

    V = tiny_target.vocab_size

    class SlowOnce(ContextNGramDrafter):
        calls = 0

        def propose_host(self, host):
            SlowOnce.calls += 1
            if SlowOnce.calls == 1:
                _time.sleep(0.5)
            return super().propose_host(host)

    dec = SpeculativeDecoder(tiny_target, [SlowOnce(V)], cost_curve=CostCurve.flat())
    spec = dec.speculator
    seen = []
    orig = spec.after_step

    def after(*a):
        out = orig(*a)
        seen.append(spec.draft_overhead)
        return out

    spec.after_step = after
    out = dec.generate(tiny_prompts[:1], max_new_tokens=12)
    assert [g.tokens for g in out] == [
        r.tokens for r in plain_greedy(tiny_target, tiny_prompts[:1], 12)
    ]
    assert seen[0] >= 0.5  # the slow step alone
    assert len(seen) >= 4 and max(seen[2:]) < 0.05  # two fast steps outvote it
