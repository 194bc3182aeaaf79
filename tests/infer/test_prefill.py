"""Chunked prefill: a long prompt joins a running batch one chunk per step, beside the running
rows' decode step, and every output is what prefilling it in one piece gives."""

import pytest

from redraft.errors import ConfigError
from redraft.infer import SamplingParams
from redraft.infer.budget import PREFILL_CHUNK_MAX, PREFILL_CHUNK_MIN, CostCurve, prefill_chunk
from redraft.infer.config import DecoderConfig
from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.ngram import ContextNGramDrafter, NGrammysDrafter

CURVE = CostCurve([1, 8, 64], [1.0, 1.2, 2.0])


def _prompts(V):
    """Prompts of 2 to 41 tokens (ids spread over the vocabulary)."""
    return [
        [(7 * i + 3 * j + 1) % V for j in range(n)] for i, n in enumerate((5, 41, 2, 17, 30, 9))
    ]


def _run(dec, prompts, max_new, join_at):
    """Add prompt i before step join_at[i]; returns ({prompt: tokens}, {prompt: step of its first event})."""
    eng = dec.engine()
    out, first, ids, step = {}, {}, {}, 0
    while len(out) < len(prompts):
        for i, s in enumerate(join_at):
            if s == step:
                ids[eng.add(prompts[i], SamplingParams.checked(max_new_tokens=max_new[i]))] = i
        for ev in eng.step():
            first.setdefault(ids[ev.index], step)
            if ev.done:
                out[ids[ev.index]] = ev.generation.tokens
        step += 1
        assert step < 800
    assert not eng.has_work and eng.step() == [] and eng.cache.batch == 0  # the last rows left
    return out, first


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_gives_the_unchunked_output(tiny_target, tiny_tables, chunk):
    V = tiny_target.vocab_size
    prompts = _prompts(V)
    max_new = [12, 20, 6, 15, 9, 25]  # short rows finish while long prompts are still prefilled
    join_at = [0, 1, 1, 3, 4, 10]

    def dec(c):
        return SpeculativeDecoder(
            tiny_target,
            [NGrammysDrafter(tiny_tables, V), ContextNGramDrafter(V, name="ctx")],
            cost_curve=CURVE,
            prefill_chunk=c,
        )

    ref, _ = _run(dec(0), prompts, max_new, join_at)
    out, first = _run(dec(chunk), prompts, max_new, join_at)
    assert out == ref
    singles = [
        plain_greedy(tiny_target, [p], max_new_tokens=m)[0].tokens for p, m in zip(prompts, max_new)
    ]
    assert [out[i] for i in range(len(prompts))] == singles
    # the 41-token prompt (joined before step 1, behind nothing) needs ceil(41 / chunk) chunks:
    # its first token comes in the step of its last chunk
    if chunk == 7:
        assert first[1] == 1 + -(-41 // chunk) - 1


def test_running_rows_decode_in_every_step_of_a_long_prefill(tiny_target):
    V = tiny_target.vocab_size
    dec = SpeculativeDecoder(tiny_target, [], budget=0, prefill_chunk=4)
    eng = dec.engine()
    a = eng.add([1, 2, 3], SamplingParams.checked(max_new_tokens=40))
    eng.step()
    long = [(5 * j + 2) % V for j in range(22)]
    b = eng.add(long, SamplingParams.checked(max_new_tokens=3))
    steps = []
    for _ in range(6):
        evs = eng.step()
        steps.append({ev.index for ev in evs})
        assert len(eng.prefilling) + len(eng.rows) == 2
    # 22 tokens in chunks of 4: six steps, the first token of b in the sixth; a decodes in each
    assert all(a in s for s in steps)
    assert all(b not in s for s in steps[:5]) and b in steps[5]
    while eng.has_work:
        eng.step()


def test_cancelling_a_row_being_prefilled_keeps_the_others(tiny_target):
    V = tiny_target.vocab_size
    dec = SpeculativeDecoder(
        tiny_target, [ContextNGramDrafter(V)], cost_curve=CURVE, prefill_chunk=3
    )
    prompts = _prompts(V)
    ref = [plain_greedy(tiny_target, [p], max_new_tokens=10)[0].tokens for p in prompts[:3]]
    eng = dec.engine()
    ids = [eng.add(p, SamplingParams.checked(max_new_tokens=10)) for p in prompts[:3]]
    eng.step()  # the first 5-token prompt is half in
    eng.step()
    eng.cancel(ids[1])  # 41 tokens, still being prefilled behind it
    out = {}
    while eng.has_work:
        for ev in eng.step():
            if ev.done:
                out[ev.index] = ev.generation.tokens
    assert set(out) == {ids[0], ids[2]}
    assert out[ids[0]] == ref[0] and out[ids[2]] == ref[2]


def test_the_auto_chunk_costs_no_more_than_the_running_step():
    curve = CostCurve([1, 64], [0.010, 0.074])  # 1 ms per token past a 9 ms base
    assert prefill_chunk(curve, 48) == 48
    assert (
        prefill_chunk(curve, 8 * 17) == 128
    )  # proportional past 64: c(128) = 0.148 <= c(136) < c(144)
    assert prefill_chunk(curve, 0) == PREFILL_CHUNK_MAX  # nobody decodes: nobody to stall
    assert prefill_chunk(curve, 1) == PREFILL_CHUNK_MIN  # never below the minimum
    # a flat curve (noise, or a GPU up to its last size) says nothing past it: proportional
    flat = CostCurve([1, 8, 64, 65], [0.010, 0.010, 0.010, 0.010])
    assert prefill_chunk(flat, 8) == 64 and prefill_chunk(flat, 8 * 65) == 512


def test_prefill_chunk_setting_is_checked():
    assert DecoderConfig(prefill_chunk="64").prefill_chunk == 64
    for bad in (-1, "big", 1.5):
        with pytest.raises(ConfigError, match="prefill_chunk"):
            DecoderConfig(prefill_chunk=bad)
