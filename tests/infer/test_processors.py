"""The sampling parameters people send, exact under speculation: penalties, logit_bias,
min_tokens, stop_token_ids, top_k, min_p, and log-probabilities."""

import math

import pytest
import torch

from redraft.errors import ConfigError
from redraft.infer import SamplingParams
from redraft.infer.decoder import SpeculativeDecoder
from redraft.infer.drafters.ngram import ContextNGramDrafter, NGrammysDrafter, TableDrafter
from redraft.infer.runner.cost import CostCurve

CURVE = CostCurve([1, 8, 64], [1.0, 1.1, 1.5])
PENALISED = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)


def process_ref(logits, prompt, out, p: SamplingParams, eos):
    """Reference processors, one position (plain Python over the tokens)."""
    lg = logits.double().clone()
    for t, b in p.logit_bias:
        lg[t] += b
    counts = {}
    for t in out:
        counts[t] = counts.get(t, 0) + 1
    if p.repetition_penalty != 1:
        for t in set(prompt) | set(out):
            lg[t] = lg[t] / p.repetition_penalty if lg[t] > 0 else lg[t] * p.repetition_penalty
    for t, c in counts.items():
        lg[t] -= p.frequency_penalty * c + p.presence_penalty
    if len(out) < p.min_tokens:
        for t in set(eos) | set(p.stop_token_ids):
            lg[t] = -math.inf
    return lg


def ref_greedy(target, prompt, p: SamplingParams):
    """Plain greedy with the processors, a full forward per token (no cache, no engine)."""
    out = []
    with torch.no_grad():
        for _ in range(p.max_new_tokens):
            logits = target.model(torch.tensor([prompt + out])).logits[0, -1]
            t = int(process_ref(logits, prompt, out, p, target.eos_token_ids).argmax())
            out.append(t)
            if t in target.eos_token_ids or t in p.stop_token_ids:
                break
    return out


def _run(dec, prompts, params):
    eng = dec.engine()
    ids = {eng.add(p, s): i for i, (p, s) in enumerate(zip(prompts, params))}
    out = {}
    while eng.has_work:
        for ev in eng.step():
            if ev.done:
                out[ids[ev.index]] = ev.generation
    return [out[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def prompts(tiny_target):
    enc = lambda t: list(tiny_target.tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    return [
        enc("The quick brown fox jumps over the lazy dog. The quick brown"),
        enc("def add(a, b):"),
        enc("Hello there, hello there"),
    ]


def test_greedy_with_processors_equals_the_reference_and_plain_greedy(
    tiny_target, tiny_tables, prompts
):
    V = tiny_target.vocab_size
    params = [
        SamplingParams.checked(24, **PENALISED),
        SamplingParams.checked(24, logit_bias={prompts[1][0]: 4.0, 7: -100}),
        SamplingParams.checked(24),
    ]  # a row without processors beside them
    refs = [ref_greedy(tiny_target, p, s) for p, s in zip(prompts, params)]
    unprocessed = ref_greedy(tiny_target, prompts[0], SamplingParams.checked(24))
    assert refs[0] != unprocessed  # the penalties change this output: the test has teeth
    plain = _run(SpeculativeDecoder(tiny_target, [], budget=0), prompts, params)
    assert [g.tokens for g in plain] == refs
    for budget in ("auto", 12):
        drafters = [NGrammysDrafter(tiny_tables, V), ContextNGramDrafter(V, name="ctx")]
        spec = _run(
            SpeculativeDecoder(tiny_target, drafters, cost_curve=CURVE, budget=budget),
            prompts,
            params,
        )
        assert [g.tokens for g in spec] == refs
        assert (
            sum(g.stats.accepted_tokens for g in spec) > 0
        )  # drafts were accepted under the penalties


def test_min_tokens_holds_off_eos_and_stop_token_ids(tiny_target, tiny_tables, prompts):
    eos = tiny_target.eos_token_ids[0]
    stop = 5
    params = [
        SamplingParams.checked(20, logit_bias={eos: 100.0}, min_tokens=6),
        SamplingParams.checked(20, logit_bias={stop: 100.0}, min_tokens=3, stop_token_ids=[stop]),
    ]
    dec = SpeculativeDecoder(
        tiny_target, [TableDrafter(tiny_tables, "bigram", k=4)], cost_curve=CURVE, budget=8
    )
    a, b = _run(dec, prompts[:2], params)
    assert (
        len(a.tokens) == 7
        and a.tokens[-1] == eos
        and eos not in a.tokens[:-1]
        and a.finish_reason == "eos"
    )
    assert len(b.tokens) == 4 and b.tokens[-1] == stop and b.finish_reason == "stop"
    assert [a.tokens, b.tokens] == [
        ref_greedy(tiny_target, p, s) for p, s in zip(prompts[:2], params)
    ]


def test_sampling_keeps_the_processed_distribution(tiny_target, tiny_tables):
    """Many seeds of one prompt, frequency penalty + bias + top_k + min_p: the second token (the
    first one speculation verifies, after a tree node) follows sum_t1 p'(t1) p'(t2 | t1)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    ids = tiny_target.chat_ids([{"role": "user", "content": "Hello"}])
    n, V = 1500, tiny_target.vocab_size
    s = SamplingParams.checked(
        2,
        temperature=1.0,
        frequency_penalty=2.0,
        logit_bias={11: 2.0},
        top_k=40,
        min_p=0.02,
        seed=0,
    )
    dec = SpeculativeDecoder(
        tiny_target, [TableDrafter(tiny_tables, "bigram", k=4)], acceptance="rejection", budget=4
    )
    out = dec.generate([ids] * n, max_new_tokens=2, temperature=1.0, seed=0)  # warm: not processed
    eng = dec.engine()
    for i in range(n):
        eng.add(
            ids,
            SamplingParams.checked(
                2,
                temperature=1.0,
                frequency_penalty=2.0,
                logit_bias={11: 2.0},
                top_k=40,
                min_p=0.02,
                seed=i,
            ),
        )
    out = []
    while eng.has_work:
        out += [ev.generation for ev in eng.step() if ev.done]
    second = torch.tensor([o.tokens[1] for o in out if len(o.tokens) > 1])

    def warped(lg):  # temperature 1, min_p, top_k
        p = lg.softmax(-1)
        p = torch.where(p >= s.min_p * p.max(), p, 0)
        p = torch.where(p >= p.topk(s.top_k).values[-1], p, 0)
        return p / p.sum()

    with torch.no_grad():
        l1 = tiny_target.model(torch.tensor([ids])).logits[0, -1]
        p1 = warped(process_ref(l1, ids, [], s, []))
        l2 = tiny_target.model(torch.tensor([ids + [t] for t in range(V)])).logits[:, -1]
        p2 = torch.stack([warped(process_ref(l2[t], ids, [t], s, [])) for t in range(V)])
    marg = (p1[:, None] * p2).sum(0)
    obs = torch.bincount(second, minlength=V).double()
    exp = marg / marg.sum() * obs.sum()
    keep = exp > 5
    obs_k = torch.cat([obs[keep], obs[~keep].sum()[None]])
    exp_k = torch.cat([exp[keep], exp[~keep].sum()[None]])
    assert obs[exp == 0].sum() == 0  # nothing outside top_k / min_p
    assert scipy_stats.chisquare(obs_k, exp_k / exp_k.sum() * obs_k.sum()).pvalue > 1e-3
    assert sum(o.stats.accepted_hist.get(1, 0) for o in out) > 30  # drafts were accepted


def test_logprobs_are_those_of_the_processed_distribution(tiny_target, tiny_tables, prompts):
    V = tiny_target.vocab_size
    s = SamplingParams.checked(12, logprobs=3, frequency_penalty=1.0)
    dec = SpeculativeDecoder(
        tiny_target, [NGrammysDrafter(tiny_tables, V)], cost_curve=CURVE, budget=8
    )
    g, other = _run(dec, prompts[:2], [s, SamplingParams.checked(12)])
    assert other.logprobs is None
    assert len(g.logprobs) == len(g.tokens) and [x.token for x in g.logprobs] == g.tokens
    with torch.no_grad():
        for i, x in enumerate(g.logprobs):
            lg = tiny_target.model(torch.tensor([prompts[0] + g.tokens[:i]])).logits[0, -1]
            lp = process_ref(lg, prompts[0], g.tokens[:i], s, []).log_softmax(-1)
            top = lp.topk(3)
            assert x.logprob == pytest.approx(float(lp[x.token]), abs=1e-3)
            assert [t for t, _ in x.top] == top.indices.tolist()
            assert [v for _, v in x.top] == pytest.approx(top.values.tolist(), abs=1e-3)
    assert g.stats.accepted_tokens > 0


def test_sampling_parameters_are_checked_naming_the_field(tiny_target):
    for kw, name in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": 11}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
    ]:
        with pytest.raises(ConfigError) as e:
            SamplingParams.checked(10, **kw)
        assert e.value.param == name
    assert SamplingParams.checked(10, top_k=-1).top_k == 0
    eng = SpeculativeDecoder(tiny_target, []).engine()
    with pytest.raises(ConfigError) as e:
        eng.add([1, 2], SamplingParams.checked(4, logit_bias={tiny_target.vocab_size: 1.0}))
    assert e.value.param == "logit_bias"
