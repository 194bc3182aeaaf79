"""Chunked prefill: a long prompt joins a running batch one chunk per step, beside the running
rows' decode step, and every output is what prefilling it in one piece gives."""

import types

import numpy as np
import pytest
import torch

from redraft.errors import ConfigError
from redraft.infer import SamplingParams
from redraft.infer.config import DecoderConfig
from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.ngram import ContextNGramDrafter, NGrammysDrafter
from redraft.infer.drafters.redrafter.drafter import ReDrafterDrafter
from redraft.infer.engine.batch import _fill_holes
from redraft.infer.engine.engine import Engine
from redraft.infer.engine.pacer import (
    PREFILL_CHUNK_MAX,
    PREFILL_CHUNK_MIN,
    PrefillPacer,
    prefill_chunk,
)
from redraft.infer.engine.rows import Row
from redraft.infer.runner.cost import CostCurve
from redraft.infer.runner.step_input import StepInput
from redraft.infer.runner.verify import Verifier

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


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_gives_the_unchunked_output(tiny_target, tiny_tables, chunk, fuse):
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
            fuse_prefill=fuse,
        )

    ref, _ = _run(dec(0), prompts, max_new, join_at)
    d = dec(chunk)
    engines, forwards = [], []  # forwards: whether rows decoded at each prefill forward's own
    engine, prefill = d.engine, d.verifier.prefill
    d.engine = lambda *a, **k: engines.append(engine(*a, **k)) or engines[-1]
    d.verifier.prefill = lambda *a, **k: forwards.append(bool(engines[0].rows)) or prefill(*a, **k)
    out, first = _run(d, prompts, max_new, join_at)
    assert out == ref
    eng = engines[0]
    assert eng.fuse == fuse and eng.totals["prefills"] == len(forwards) + eng.totals["fused"]
    if fuse:  # pieces of their own only while nobody decodes; every other one rode along
        assert not any(forwards) and eng.totals["fused"] > 5
    else:
        assert eng.totals["fused"] == 0 and sum(forwards) > 5
    singles = [
        plain_greedy(tiny_target, [p], max_new_tokens=m)[0].tokens for p, m in zip(prompts, max_new)
    ]
    assert [out[i] for i in range(len(prompts))] == singles
    # the 41-token prompt (joined before step 1, behind nothing) needs ceil(41 / chunk) chunks:
    # its first token comes in the step of its last chunk at the earliest (rows that arrive
    # later may take the slots of rows that leave, ahead of it: test_a_short_request_...)
    assert first[1] >= 1 + -(-41 // chunk) - 1


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
    out = _drain(eng)
    assert set(out) == {ids[0], ids[2]}
    assert out[ids[0]] == ref[0] and out[ids[2]] == ref[2]


def test_a_piece_in_the_verify_forward_gives_what_two_forwards_give(tiny_target):
    """verify_with_piece: the verify's hidden states, the piece's last hidden state and every
    cache entry equal (to float32 rounding) a verify forward then a prefill forward; nothing
    else in the cache changes."""
    V = tiny_target.vocab_size
    v = Verifier(tiny_target)
    assert v.can_fuse and not Verifier(tiny_target, static=True).can_fuse
    rows = [[(3 * i + 5 * j + 1) % V for j in range(n)] for i, n in enumerate((7, 19, 4))]
    long = [(11 * j + 2) % V for j in range(20)]
    N = 4  # a tree: root, two children, a grandchild under the first
    depth, parent = torch.tensor([0, 1, 1, 2]), torch.tensor([-1, 0, 0, 1])
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (3, N), generator=g)
    step = StepInput(
        torch.cat(
            [
                torch.tensor([7, 19, 4])[:, None],
                tokens,
                depth.expand(3, N),
                parent.expand(3, N),
                anc.reshape(1, -1).expand(3, -1),
            ],
            1,
        ),
        N,
    )

    def cache_with_rows():
        cache = v.new_cache(6, 64)
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))  # columns nobody may touch
        v.prefill(rows, cache, first_slot=0)
        cache.host_lengths, cache.batch = [7, 19, 4], 3
        v.prefill([long[:6]], cache, first_slot=5)  # a parked row, 6 tokens in
        return cache

    a = cache_with_rows()
    before = a.kv.clone()
    hidden = v.verify(step, a).clone()
    last = v.prefill([long[6:15]], a, first_slot=5, starts=[6])
    b = cache_with_rows()
    b.kv.copy_(before)
    hidden2, last2 = v.verify_with_piece(step, b, [long[6:15]], 5, [6])
    assert b.piece is None  # the piece ends with its forward
    assert torch.allclose(hidden, hidden2, atol=1e-5) and torch.allclose(last, last2, atol=1e-5)
    assert torch.allclose(a.kv, b.kv, atol=1e-6)
    changed = (b.kv != before).any(dim=(0, 1, 3, 5))  # [slots, columns] written
    assert changed[5, 6:15].all() and not changed[5, 15:].any() and not changed[5, :6].any()
    for slot, n in enumerate((7, 19, 4)):  # the tree's 4 columns after each row
        assert changed[slot, n : n + N].all() and not changed[slot, n + N :].any()
    assert not changed[3:5].any()
    # two fresh prompts as the piece (padded to the longer), into slots 3 and 4
    c = cache_with_rows()
    hidden3, last3 = v.verify_with_piece(step, c, [long[:5], long[5:8]], 3, [0, 0])
    ref = v.prefill([long[:5], long[5:8]], a, first_slot=3)
    assert torch.allclose(hidden3, hidden, atol=1e-5) and torch.allclose(last3, ref, atol=1e-5)


def test_the_pacer_fits_a_riding_pieces_own_cost_across_steps():
    """Pieces in the verify forward: the pacer fits ``seconds = k c(verify) + N (a + b span)``
    over steps of different tree and piece sizes (one step's time does not say how it splits),
    and holds the piece's own cost, no fixed cost first, to the share of the reference step."""
    curve = CostCurve([1, 64], [0.010, 0.074])
    p = PrefillPacer(1.0)
    # before any step without a piece: the reference step is the curve's cost of the verify
    p.observe_verify(0.2, 48, curve, 16, 16)
    assert p.ref == pytest.approx(0.010 + 47 * 0.064 / 63) and p.fused_coefficients() is None
    p = PrefillPacer(1.0)
    p.observe(64, 64, 0.010 + 64 * 0.003, curve)  # a forward of its own (nobody decoded)
    g = np.random.default_rng(0)
    for i in range(40):
        vt, N, S = (
            int(g.integers(4, 40)),
            int(g.integers(0, 64)) * (i % 4 > 0),
            int(g.integers(16, 3000)),
        )
        c = 0.010 + (vt - 1) * 0.064 / 63
        p.observe_verify(1.5 * c + N * (0.002 + 1e-6 * S), vt, curve, N, S)
        if i == 2:  # fewer than 4 pieces timed: a forward of its own's cost past c0 (3 ms)
            fits = p.fits(fused=True)
            assert p.fused_coefficients() is None and fits(5, 64) and not fits(60, 64)
    a, b = p.fused_coefficients()
    assert a == pytest.approx(0.002, rel=1e-6) and b == pytest.approx(1e-6, rel=1e-6)
    p.largest, ref = 10_000, p.ref
    budget = ref  # one reference step: N (a + b S) <= ref
    n = int(budget / (0.002 + 1e-6 * 1000))
    assert p.fits(fused=True)(n, 1000) and not p.fits(fused=True)(n + 1, 1000)
    assert p.fits(fused=True, steps=2)(2 * n, 1000)
    # what a piece adds to the step it rides in: its fitted own cost
    assert p.piece_seconds(100, 500, curve) == pytest.approx(100 * (0.002 + 5e-4), rel=1e-6)
    # before any fit: a forward of its own's past the fixed cost, else the curve's c(N) - c(1)
    q = PrefillPacer()
    assert q.piece_seconds(33, 0, curve) == pytest.approx(32 * 0.064 / 63)
    q.observe(64, 64, 0.010 + 64 * 0.003, curve)
    assert q.piece_seconds(10, 64, curve) == pytest.approx(0.030)


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


def test_the_pacer_predicts_a_chunks_cost_from_its_tokens_and_span():
    curve = CostCurve([1, 64], [0.010, 0.074])  # a forward's fixed cost: 10 ms
    pacer = PrefillPacer()
    assert pacer.fits() is None  # nothing timed yet: the engine uses the cost curve
    # forwards that cost 1 ms per token plus 1 us per token and attended column (attention)
    for N, span in ((48, 100), (32, 2000), (64, 1000)):
        pacer.observe(N, span, 0.010 + N * (0.001 + 1e-6 * span), curve)
    assert pacer.fits() is None  # ... and no verify step yet
    a, b = pacer.coefficients()
    assert a == pytest.approx(0.001) and b == pytest.approx(1e-6)
    pacer.observe_step(0.1)
    assert pacer.fits()(90, 0) and not pacer.fits()(91, 0)  # a chunk may cost one step, 0.1 s
    fits = pacer.fits(0.8)  # or 0.8 steps: 70 ms past the fixed cost
    assert fits(70, 0) and not fits(71, 0)
    assert fits(17, 3000) and not fits(18, 3000)  # 4 ms per token over 3,000 columns
    assert not fits(129, 0)  # never more than twice the largest forward timed (64 tokens)
    # the reference step is a slow average: one slow step (a busy moment) moves it a little
    pacer.observe_step(1.0)
    assert pacer.ref == pytest.approx(0.95 * 0.1 + 0.05 * 1.0)
    # per-token costs that fall with the span say nothing about attention: a flat rate
    flat = PrefillPacer()
    flat.observe(10, 100, 0.010 + 10 * 0.003, curve)
    flat.observe(10, 2000, 0.010 + 10 * 0.001, curve)
    assert flat.coefficients()[1] == 0.0
    assert flat.coefficients()[0] == pytest.approx((0.9 * 0.003 + 0.001) / 1.9)  # newer weighs more

    # the pacer drives the engine's pieces: one row's piece is the largest that fits, cut to
    # a multiple of 16; rows finished by one forward share it while their padding stays small
    class _Eng:
        config = DecoderConfig()
        fuse, rows = False, []
        verifier = types.SimpleNamespace(ragged_prefill=False)  # padded prefill forwards

    eng = _Eng()
    eng.prefilling = [_row(400, filled=0)]
    assert Engine._chunk_rows(eng, fits) == (1, 64)  # 65 fits -> 64
    eng.prefilling = [_row(4000, filled=2800)]  # late in a long prompt: attention costs more
    assert Engine._chunk_rows(eng, fits) == (1, 16)  # 18 fit -> 16
    eng.prefilling = [_row(4000, filled=3900)]  # under 16 fit: exactly what fits
    assert Engine._chunk_rows(eng, fits) == (1, 14)
    eng.prefilling = [_row(20), _row(30), _row(31), _row(60)]
    assert Engine._chunk_rows(eng, fits) == (2, 30)  # 3 x 31 > 70 ms; 3 x 60 too padded
    eng.prefilling = [_row(40, filled=30), _row(12)]  # a last piece goes alone
    assert Engine._chunk_rows(eng, fits) == (1, 10)
    eng.prefilling = [_row(10), _row(20), _row(35)]
    assert Engine._chunk_rows(eng, fits) == (2, 20)  # 3 x 35 > 70 ms
    eng.verifier.ragged_prefill = True  # a flattened prefill forward costs its own tokens
    assert Engine._chunk_rows(eng, fits) == (3, 35)  # 10 + 20 + 35 fit
    eng.prefilling = [_row(20), _row(30), _row(31)]
    assert Engine._chunk_rows(eng, fits) == (2, 30)  # 81 tokens do not
    eng.verifier.ragged_prefill = False
    # a piece riding in the running rows' verify forward: not rounded (no shape to keep)
    eng.fuse, eng.rows = True, [_row(5)]
    eng.prefilling = [_row(400, filled=0)]
    assert Engine._chunk_rows(eng, fits) == (1, 65)
    eng.prefilling = [_row(4000, filled=2800)]
    assert Engine._chunk_rows(eng, fits) == (1, 18)


def test_the_pacer_takes_an_eager_prefills_fixed_cost_where_verifies_replay_graphs():
    """On a GPU the curve's one-token verify is a graph replay (a few ms for the default target
    on a GPU) while prefill pieces run eagerly, with a larger fixed cost: read as a per-token
    cost, that difference made every piece small."""
    replayed = CostCurve([1, 64], [0.004, 0.005], prefill_c0=0.012)
    assert CostCurve.from_ms(replayed.to_dict()).prefill_c0 == pytest.approx(0.012)
    pieces = ((32, 100, 0.0136), (64, 200, 0.0152))  # eager: 12 ms + 50 us per token
    for curve, a in ((replayed, 50e-6), (CostCurve([1, 64], [0.004, 0.005]), None)):
        pacer = PrefillPacer()
        for N, span, secs in pieces:
            pacer.observe(N, span, secs, curve)
        got = pacer.coefficients()[0]
        if a is not None:
            assert pacer.c0 == pytest.approx(0.012) and got == pytest.approx(a, rel=0.05)
        else:  # the replay's 4 ms as the fixed cost: several times the per-token cost
            assert pacer.c0 == pytest.approx(0.004) and got > 3 * 50e-6


def test_a_fixed_cost_above_the_share_still_lets_pieces_amortise_it():
    """On a GPU eager prefill forwards cost 34 ms fixed, the decode steps 3.5-4 ms
    replays, so 8 reference steps (the idle allowance) were less than the fixed cost alone:
    every piece fit nothing and was cut to one token (2.5 s to prefill a chat prompt)."""
    curve = CostCurve([1, 64], [0.0035, 0.0045], prefill_c0=0.034)
    pacer = PrefillPacer()
    pacer.observe(32, 100, 0.034 + 32 * 50e-6, curve)
    pacer.observe(64, 200, 0.034 + 64 * 50e-6, curve)
    pacer.observe_step(0.004)
    fits = pacer.fits(8)  # 32 ms allowed < the 34 ms fixed cost
    # up to 34 ms of per-token work (680 tokens at 50 us), bounded by twice the largest timed
    assert fits(128, 200) and not fits(129, 200)
    pacer.observe(512, 600, 0.034 + 512 * 50e-6, curve)
    fits = pacer.fits(8)
    assert fits(660, 700) and not fits(700, 700)
    # a share above the fixed cost: the share less the fixed cost, as before
    pacer.ref = 0.010  # 80 ms allowed: 46 ms past the fixed cost, 920 tokens
    fits = pacer.fits(8)
    assert fits(900, 700) and not fits(925, 700)


def test_a_graph_verifier_measures_an_eager_prefills_fixed_cost(tiny_target):
    from redraft.infer.runner.verify import Verifier

    eager = Verifier(tiny_target, static=True)
    assert eager.measure_cost(max_nodes=4, context=16).prefill_c0 is None  # CPU: no graphs
    graphs = Verifier(tiny_target, static=True, graphs=True, capture=_replaying_capture)
    curve = graphs.measure_cost(max_nodes=4, context=16)
    assert curve.prefill_c0 is not None and curve.prefill_c0 > 0
    assert "prefill_ms" in curve.to_dict()


def _replaying_capture(fn, device, pool):
    out = fn()

    class G:
        def replay(self):
            out.copy_(fn())

    return G(), out


def _drain(eng, out=None) -> dict:
    """Step ``eng`` until it has no work; ``{request id: output tokens}`` of those that finish."""
    out = {} if out is None else out
    while eng.has_work:
        for ev in eng.step():
            if ev.done:
                out[ev.index] = ev.generation.tokens
    return out


def _row(n, filled=0):
    r = Row(0, list(range(n)), SamplingParams.checked(), None, None)
    r.filled = filled
    return r


def test_rows_leaving_move_one_row_each_and_outputs_stay_exact(tiny_target, tiny_tables, tiny_head):
    """Rows leave while others are prefilled behind them: the rows above the new end fill the
    holes (device drafter state reordered with them), and every output is its single-row one."""
    V = tiny_target.vocab_size
    prompts = _prompts(V) + [[(11 * j + 5) % V for j in range(n)] for n in (3, 26, 4)]
    max_new = [3, 20, 4, 15, 2, 25, 5, 8, 3]
    join_at = [0, 0, 0, 1, 1, 2, 3, 3, 6]
    dec = SpeculativeDecoder(
        tiny_target,
        [NGrammysDrafter(tiny_tables, V), ReDrafterDrafter(tiny_head, width=2, length=3)],
        cost_curve=CURVE,
        prefill_chunk=5,
    )
    out, _ = _run(dec, prompts, max_new, join_at)
    singles = [
        plain_greedy(tiny_target, [p], max_new_tokens=m)[0].tokens for p, m in zip(prompts, max_new)
    ]
    assert [out[i] for i in range(len(prompts))] == singles


def test_fill_holes_moves_only_the_rows_above_the_new_end():
    assert _fill_holes([0, 1, 3, 4, 5], 0) == [0, 1, 5, 3, 4]  # row 2 left: row 5 takes its slot
    assert _fill_holes([0, 2, 3, 4, 6, 7], 0) == [0, 6, 2, 3, 4, 7]
    assert _fill_holes([9, 10, 11], 8) == [11, 9, 10]  # rows being prefilled, two slots down
    assert _fill_holes([8, 9], 8) == [8, 9]  # nothing left below them: nothing moves


def test_keep_rows_copies_only_moved_rows_and_their_columns(tiny_target):
    cache = Verifier(tiny_target).new_cache(4, 16)
    cache.batch, cache.host_lengths = 4, [3, 5, 2, 7]
    cache.kv.copy_(torch.randn_like(cache.kv))
    before = cache.kv.clone()
    cache.keep_rows([0, 3, 2], columns=8)  # row 1 left; row 3 fills its slot
    assert cache.batch == 3 and cache.host_lengths == [3, 7, 2]
    assert torch.equal(cache.kv[:, :, 1, :, :8], before[:, :, 3, :, :8])
    assert torch.equal(
        cache.kv[:, :, 1, :, 8:], before[:, :, 1, :, 8:]
    )  # past the columns: untouched
    assert torch.equal(
        cache.kv[:, :, [0, 2, 3]], before[:, :, [0, 2, 3]]
    )  # unmoved rows: untouched


def test_a_short_request_goes_ahead_of_a_long_prefill_and_nothing_of_it_moves(tiny_target):
    V = tiny_target.vocab_size
    dec = SpeculativeDecoder(tiny_target, [], budget=0, prefill_chunk=8)
    eng = dec.engine()
    a = eng.add([1, 2, 3], SamplingParams.checked(max_new_tokens=3))
    b = eng.add([4, 5, 6], SamplingParams.checked(max_new_tokens=30))
    eng.step()  # a and b join (6 prompt tokens: one chunk)
    long = [(5 * j + 2) % V for j in range(40)]
    c = eng.add(long, SamplingParams.checked(max_new_tokens=3))
    eng.step()  # a's last token; c's first chunk, in a parked slot above the batch
    assert eng.prefilling[0].rid == c and eng.prefilling[0].filled == 8
    slot = eng.prefilling[0].slot
    assert slot >= eng.cache.batch + len(eng.prefilling)
    assert [(r.rid, r.done) for r in eng.rows] == [(a, True), (b, False)]
    kv_c = eng.cache.kv[:, :, slot, :, :8].clone()
    assert kv_c.abs().sum() > 0
    d = eng.add([7, 8], SamplingParams.checked(max_new_tokens=2))
    evs = eng.step()  # a leaves; d (2 tokens left) goes ahead of c (32 left) and joins
    assert [r.rid for r in eng.rows] == [b, d]
    assert eng.prefilling[0].rid == c and eng.prefilling[0].filled == 8  # c waited
    assert eng.prefilling[0].slot == slot and torch.equal(eng.cache.kv[:, :, slot, :, :8], kv_c)
    assert d in {ev.index for ev in evs}
    out = {ev.index: ev.generation.tokens for ev in evs if ev.done}
    _drain(eng, out)
    for rid, p, m in ((b, [4, 5, 6], 30), (c, long, 3), (d, [7, 8], 2)):
        assert out[rid] == plain_greedy(tiny_target, [p], max_new_tokens=m)[0].tokens


def test_parked_rows_move_up_when_the_queue_grows_into_their_slots(tiny_target):
    """Many requests arrive while a long prompt is parked: the slots they may join into would
    reach its slot, so it moves up (its cached columns with it), and every output is exact."""
    V = tiny_target.vocab_size
    dec = SpeculativeDecoder(tiny_target, [], budget=0, prefill_chunk=6)
    eng = dec.engine()
    long = [(3 * j + 1) % V for j in range(30)]
    ids = {eng.add([1, 2], SamplingParams.checked(max_new_tokens=20)): ([1, 2], 20)}
    eng.step()
    ids[eng.add(long, SamplingParams.checked(max_new_tokens=4))] = (long, 4)
    eng.step()  # the long prompt's first piece, parked
    first = eng.prefilling[0].slot
    shorts = [[(7 * i + j) % V for j in range(3)] for i in range(6)]
    for p in shorts:
        ids[eng.add(p, SamplingParams.checked(max_new_tokens=5))] = (p, 5)
    eng.step()
    parked = [r for r in eng.prefilling if r.slot is not None]
    assert parked and parked[0].slot > first  # moved up, above the queue's slots
    assert parked[0].slot >= eng.cache.batch + len(eng.prefilling)
    out = _drain(eng)
    for rid, (p, m) in ids.items():
        assert out[rid] == plain_greedy(tiny_target, [p], max_new_tokens=m)[0].tokens


@pytest.mark.parametrize("ragged", [True, False])
def test_prompts_joining_together_prefill_in_forwards_of_similar_lengths(tiny_target, ragged):
    """Nobody decodes: every waiting prompt is prefilled before the first step, shortest first.
    A flattened prefill (a CPU verifier's: no padding) takes them all in one forward; padded
    forwards keep their padding under MAX_PADDING (not one forward padded to the longest)."""
    V = tiny_target.vocab_size
    lengths = [12, 30, 70, 3, 5, 11, 4, 33]
    prompts = [[(3 * i + 5 * j + 1) % V for j in range(n)] for i, n in enumerate(lengths)]
    dec = SpeculativeDecoder(tiny_target, [], budget=0)
    eng = dec.engine()
    assert eng.verifier.ragged_prefill  # a CPU target
    eng.verifier.ragged_prefill = ragged
    forwards = []
    prefill = eng.verifier.prefill

    def spy(pieces, *a, **k):
        forwards.append(sorted(len(p) for p in pieces))
        return prefill(pieces, *a, **k)

    eng.verifier.prefill = spy
    ids = [eng.add(p, SamplingParams.checked(max_new_tokens=4)) for p in prompts]
    eng.step()
    assert len(eng.rows) == len(prompts) and not eng.prefilling  # all joined in the first step
    if ragged:
        assert forwards == [sorted(lengths)]  # one forward of their 168 tokens
    else:
        assert forwards == [[3, 4, 5], [11, 12], [30, 33], [70]]  # sorted, padding <= 50%
    out = _drain(eng)
    for rid, p in zip(ids, prompts):
        assert out[rid] == plain_greedy(tiny_target, [p], max_new_tokens=4)[0].tokens


def test_a_flattened_prefill_gives_what_padded_forwards_give(tiny_target):
    """A CPU verifier prefills its pieces as one flattened row, no padding
    (``Verifier.ragged_prefill``): the model sees only the pieces' own tokens, and the last
    hidden states and the cache entries are those of the padded forward, for whole prompts and
    for later pieces of prompts (attending over their earlier tokens in the cache)."""
    V = tiny_target.vocab_size
    prompts = [[(5 * i + 3 * j + 1) % V for j in range(n)] for i, n in enumerate((9, 2, 23, 14))]
    later = [[7, 8, 9], [10, 11, 12, 13, 14]]  # rows 0 and 1 again, after their prompts
    got, seen = {}, []
    embed = tiny_target.model.get_input_embeddings()
    hook = embed.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    try:
        for ragged in (True, False):
            v = Verifier(tiny_target)
            assert v.ragged_prefill
            v.ragged_prefill = ragged
            cache = v.new_cache(5, 48)
            seen.clear()
            with torch.inference_mode():
                h = v.prefill(prompts, cache, first_slot=1)
                h2 = v.prefill(later, cache, first_slot=1, starts=[9, 2])
            lengths = [12, 7, 23, 14]
            kv = [cache.kv[:, :, 1 + b, :, :n].clone() for b, n in enumerate(lengths)]
            got[ragged] = (h, h2, kv, list(seen))
            assert not cache.kv[:, :, 0].any()  # a slot outside the forwards' is untouched
    finally:
        hook.remove()
    assert got[True][3] == [(1, 48), (1, 8)]  # every token a prompt's: no padding
    assert got[False][3] == [(4, 23), (2, 5)]
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[True][1], got[False][1], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[True][2], got[False][2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_growing_cache_keeps_what_forwards_wrote(tiny_target):
    """Growing copies only the columns forwards have written (``high``), all slots; the new
    room is zeros."""
    v = Verifier(tiny_target)
    cache = v.new_cache(2, 16)
    v.prefill([[1, 2, 3, 4, 5], [6, 7]], cache, first_slot=0)
    assert cache.high == 5
    before = cache.kv[:, :, :2, :, :5].clone()
    assert cache.reserve(4, 40)
    assert cache.kv.shape[2] == 4 and cache.kv.shape[4] == 40
    assert torch.equal(cache.kv[:, :, :2, :, :5], before)
    assert not cache.kv[:, :, :, :, 5:].any() and not cache.kv[:, :, 2:].any()


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones(tiny_target):
    """Shortest first, but every other piece goes to the oldest request: a short request arriving
    every step cannot hold a long prompt back for ever, and every output stays exact."""
    V = tiny_target.vocab_size
    dec = SpeculativeDecoder(tiny_target, [], budget=0, prefill_chunk=4)
    eng = dec.engine()
    ids = {eng.add([1, 2, 3], SamplingParams.checked(max_new_tokens=40)): ([1, 2, 3], 40)}
    eng.step()
    long = [(3 * j + 1) % V for j in range(24)]
    rid = eng.add(long, SamplingParams.checked(max_new_tokens=3))
    ids[rid] = (long, 3)
    first, out = None, {}
    for step in range(60):
        p = [(5 * step + j) % V for j in range(3)]
        ids[eng.add(p, SamplingParams.checked(max_new_tokens=2))] = (p, 2)
        for ev in eng.step():
            if ev.index == rid and first is None:
                first = step
            if ev.done:
                out[ev.index] = ev.generation.tokens
        if first is not None:
            break
    assert first is not None and first <= 2 * 24 // 4  # a piece every other step at least
    _drain(eng, out)
    for r, (p, m) in ids.items():
        assert out[r] == plain_greedy(tiny_target, [p], max_new_tokens=m)[0].tokens


def test_prefill_share_sets_what_a_piece_may_cost(tiny_target):
    curve = CostCurve([1, 64], [0.010, 0.074])
    pacers = [
        SpeculativeDecoder(tiny_target, [], budget=0, prefill_share=s).engine()._pacer
        for s in (1.0, 2.5)
    ]
    for p in pacers:
        p.observe(32, 0, 0.010 + 32 * 0.001, curve)
        p.observe_step(0.1)
    # 1 step: 90 ms past the fixed cost (90 tokens, at most twice the 32 timed); 2.5: 240 ms
    assert pacers[0].fits()(64, 0) and not pacers[0].fits()(91, 0)
    pacers[1].largest = 1000
    assert pacers[1].fits()(240, 0) and not pacers[1].fits()(241, 0)
    with pytest.raises(ConfigError, match="prefill_share"):
        DecoderConfig(prefill_share=0)
    with pytest.raises(ConfigError, match="fuse_prefill"):
        DecoderConfig(fuse_prefill="yes")


def test_a_long_prompt_grows_the_cache_once_at_its_first_piece(tiny_target):
    """Admitting a long prompt adds no columns yet; its first piece grows the cache to what it
    needs to its end, once (every growth copies the rows' columns), and every output stays
    exact."""
    V = tiny_target.vocab_size
    dec = SpeculativeDecoder(tiny_target, [], budget=0, prefill_chunk=8)
    eng = dec.engine()
    short = [1, 2, 3]
    ids = {eng.add(short, SamplingParams.checked(max_new_tokens=60)): (short, 60)}
    eng.step()
    cap = eng.cache.capacity
    long = [(7 * j + 3) % V for j in range(3 * cap)]
    ids[eng.add(long, SamplingParams.checked(max_new_tokens=3))] = (long, 3)
    eng._admit(eng.waiting)  # admitted: slots for it, no columns yet
    eng.waiting = []
    gen = eng.cache.generation
    assert eng.cache.capacity == cap
    eng.step()  # its first piece
    assert eng.prefilling[0].filled == 8 and eng.cache.capacity >= 3 * cap + 3
    assert eng.cache.generation == gen + 1
    out = _drain(eng)
    assert eng.cache.generation == gen + 1  # its later pieces and its joining grew nothing
    for rid, (p, m) in ids.items():
        assert out[rid] == plain_greedy(tiny_target, [p], max_new_tokens=m)[0].tokens


def test_a_cpu_cache_buffer_is_zero_and_takes_memory_only_where_written():
    """:func:`~redraft.infer.runner.kv.zeroed`: zeros everywhere, writable, the same shape and dtype as
    ``torch.zeros``; pages never written are never resident (an anonymous map)."""
    import os

    from redraft.infer.runner.kv import zeroed

    def resident_mib():  # this process's resident memory now (Linux)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    t = zeroed((2, 3, 5), torch.float32, "cpu")
    assert t.shape == (2, 3, 5) and t.dtype == torch.float32 and not t.any()
    t[1, 2] = 7.0
    assert t.sum() == 35.0 and t[0].abs().sum() == 0
    assert zeroed((0, 4), torch.bfloat16, "cpu").shape == (0, 4)
    before = resident_mib()
    big = zeroed((64, 1024, 1024), torch.float32, "cpu")  # 256 MiB
    big[0, 0, :8] = 1.0  # one page touched
    lazy = resident_mib() - before
    assert float(big[0, 0].sum()) == 8.0
    del big
    before = resident_mib()
    # the control: the measure sees every page once written (a fresh map, not memory the
    # allocator kept from earlier tensors, which would already be resident)
    full = zeroed((64, 1024, 1024), torch.float32, "cpu").fill_(1.0)
    eager = resident_mib() - before
    assert eager > 200 and lazy < 32 and full.shape == (64, 1024, 1024)


def test_a_burst_of_waiting_requests_gets_bigger_pieces(tiny_target):
    """Pieces may cost one reference step (scaled by the curve to the admitted requests), or, in
    a burst of more requests waiting than decoding, one step per waiting request per decoding row
    (at most IDLE_STEPS)."""
    from redraft.infer.engine.scheduler import IDLE_STEPS

    flat = CostCurve([1, 4096], [1.0, 1.0])  # a flat curve: scaling alone gives 1 step
    dec = SpeculativeDecoder(tiny_target, [], budget=0, cost_curve=flat)
    eng = dec.engine()
    asked = []
    eng._pacer.fits = lambda steps=1.0, fused=False: asked.append(steps) or (lambda N, S: True)
    eng._step_tokens = 2
    for B, P in ((8, 2), (2, 8), (1, 15)):
        eng.rows = [_row(5) for _ in range(B)]
        eng.prefilling = [_row(100) for _ in range(P)]
        eng._chunk_limit()
    assert asked == [1.0, 4.0, IDLE_STEPS]


def test_a_growing_cache_copies_the_columns_its_rows_use(tiny_target):
    """``reserve(..., used)`` copies each listed slot's first columns and nothing else (the
    engine lists its rows' lengths and its parked rows' pieces); without ``used``, every slot up
    to the columns any forward wrote."""
    from redraft.infer.runner.kv import SlotKVCache

    cfg = tiny_target.model.config
    cache = SlotKVCache(cfg, 3, 16, torch.float32, "cpu")
    cache.kv.copy_(torch.randn_like(cache.kv))
    cache.high = 16
    old = cache.kv.clone()
    assert cache.reserve(5, 40, used=lambda: {0: 4, 2: 9})
    assert cache.kv.shape[2] >= 5 and cache.kv.shape[4] >= 40
    assert torch.equal(cache.kv[:, :, 0, :, :4], old[:, :, 0, :, :4])
    assert torch.equal(cache.kv[:, :, 2, :, :9], old[:, :, 2, :, :9])
    assert not cache.kv[:, :, 0, :, 4:].any() and not cache.kv[:, :, 1].any()
    assert not cache.kv[:, :, 2, :, 9:].any()
    cache.kv.copy_(torch.randn_like(cache.kv))
    cache.high, old = 7, cache.kv.clone()
    assert cache.reserve(cache.slots + 1, cache.capacity)
    assert torch.equal(cache.kv[:, :, : old.shape[2], :, :7], old[:, :, :, :, :7])
    assert not cache.kv[:, :, :, :, 7:].any()


def test_the_growth_cap_starts_at_the_largest_forward_the_curve_timed():
    """A server's warm-up prompt is one token: from that first timed piece the cap doubled piece
    by piece, and the first requests' 40-token prompts took 14 forwards of 2-4 tokens (through the
    engine on a small CPU; now one). The cost curve timed forwards of up to 64 tokens."""
    curve = CostCurve([1, 8, 64], [0.010, 0.012, 0.074])
    pacer = PrefillPacer()
    pacer.observe(1, 1, 0.011, curve)
    pacer.observe_step(0.5)
    fits = pacer.fits(8)
    assert fits(128, 128) and not fits(129, 129)  # twice the curve's 64, not twice 1 token
    # one token timed says nothing of the cost per token (its 1 ms past c0 is noise): the
    # curve's, (74 - 10) / 63 ms, until forwards of 16 tokens in all are timed
    assert pacer.coefficients() == (pytest.approx(0.064 / 63), 0.0)
    pacer.observe(15, 1, 0.010 + 15 * 0.003, curve)
    assert pacer.coefficients()[0] == pytest.approx((0.9 * 0.001 + 15 * 0.003) / 15.9)
    fused = PrefillPacer()
    fused.observe_verify(0.02, 4, curve, tokens=1, span=1)
    assert fused.largest == 64
    fused.observe_verify(0.2, 4, curve, tokens=100, span=100)
    assert fused.largest == 100


def test_an_idle_engine_times_every_piece_and_paces_the_next_by_it(tiny_target):
    """While nobody decodes a step may run several pieces; each is timed before the next is cut
    (only the step's last piece was: a 40-token prompt's pieces stayed at 16 tokens however
    often it came), and no growth cap holds them (nobody to stall), only the time allowed."""
    curve = CostCurve([1, 8], [1e-3, 1.1e-3])
    dec = SpeculativeDecoder(tiny_target, [], budget=0, cost_curve=curve)
    eng = dec.engine()
    sizes = []
    prefill = eng.verifier.prefill

    def timed(tokens, *a, **k):
        sizes.append(len(tokens[0]))
        return prefill(tokens, *a, **k)

    eng.verifier.prefill = timed
    V = tiny_target.config.vocab_size
    eng.add([3], SamplingParams.checked(max_new_tokens=2))  # a warm-up: one piece timed
    while eng.has_work:
        eng.step()
    sizes.clear()
    pacer, asked = eng._pacer, []
    pacer.ref = 100.0  # the idle allowance never runs out here
    fits = pacer.fits

    def fits_(steps=1.0, fused=False, capped=True):
        asked.append((len(pacer.obs), capped, fits(steps, fused, capped)(2048, 2048)))
        return lambda N, S: N <= 16 * (2 + len(asked))  # each piece cut anew: 48, 64, 80, ...

    pacer.fits = fits_
    eng.add([(5 * j + 1) % V for j in range(300)], SamplingParams.checked(max_new_tokens=2))
    eng.step()
    assert sizes == [48, 64, 80, 96, 12]  # one step, each piece paced after the one before it
    # timed one by one (the warm-up's piece, then each of this step's before the next), uncapped
    assert asked == [(n, False, True) for n in (1, 2, 3, 4, 5)]
    while eng.has_work:
        eng.step()


def test_an_idle_step_stops_a_long_prompts_pieces_once_prompts_have_joined(tiny_target):
    """All of a burst's prompts waiting at an idle step: the short ones are prefilled and join,
    then they decode, the long one's pieces riding with them (it used to take the long one's
    pieces for 8 reference steps first: the short ones' first tokens came 1.4-1.8 s late through
    HTTP). A long prompt alone still gets its idle pieces."""
    curve = CostCurve([1, 8], [1e-3, 1.1e-3])
    dec = SpeculativeDecoder(tiny_target, [], budget=0, cost_curve=curve, fuse_prefill=True)
    eng = dec.engine()
    eng.add([3], SamplingParams.checked(max_new_tokens=2))  # a warm-up: one piece timed
    while eng.has_work:
        eng.step()
    eng._pacer.ref = 100.0  # the idle allowance never runs out here
    eng._pacer.fits = lambda steps=1.0, fused=False, capped=True: lambda N, S: N <= 48
    V = tiny_target.config.vocab_size
    long = [(5 * j + 1) % V for j in range(300)]
    short = eng.add([(3 * j + 2) % V for j in range(6)], SamplingParams.checked(max_new_tokens=8))
    eng.add(long, SamplingParams.checked(max_new_tokens=2))
    events = eng.step()
    assert [r.rid for r in eng.rows] == [short] and any(e.index == short for e in events)
    assert 0 < eng.prefilling[0].filled < 100  # one idle piece, then it rides
    while eng.has_work:
        eng.step()
    eng.add(long, SamplingParams.checked(max_new_tokens=2))  # alone: nobody to decode
    eng.step()
    assert eng.rows and not eng.prefilling  # every piece in the one idle step
    while eng.has_work:
        eng.step()


def test_the_guard_times_a_fused_step_without_its_piece(tiny_target):
    """The speculation guard and the gate compare steps' times: a piece riding in a step's
    verify would make whichever mode ran meanwhile look slower, so they get the step's time
    less the piece's estimated cost; the stats keep the whole time."""
    V = tiny_target.vocab_size
    dec = SpeculativeDecoder(
        tiny_target, [ContextNGramDrafter(V)], budget=0, cost_curve=CURVE, fuse_prefill=True
    )
    eng = dec.engine()
    seen, estimates = [], []  # [time given to after_step, pieces estimated so far, step time]
    after, emit = dec.speculator.after_step, eng._emit

    def after_(prop, acc, credit, secs):
        seen.append([secs, len(estimates)])
        return after(prop, acc, credit, secs)

    def emit_(tree, prop, acc, credit, secs, lp=None, joint=None):
        seen[-1].append(secs)
        return emit(tree, prop, acc, credit, secs, lp, joint)

    dec.speculator.after_step, eng._emit = after_, emit_
    eng._pacer.piece_seconds = lambda N, S, c: estimates.append(N * 1e-5) or N * 1e-5
    eng.add([(3 * j + 1) % V for j in range(6)], SamplingParams.checked(max_new_tokens=30))
    eng.step()
    eng.add([(5 * j + 2) % V for j in range(200)], SamplingParams.checked(max_new_tokens=2))
    while eng.has_work:
        eng.step()
    assert eng.totals["fused"] >= 2 and len(estimates) == eng.totals["fused"]
    before = 0
    for own, n, raw in seen:
        if n > before:  # this step carried a piece
            est = estimates[before]
            assert own[0] == raw[0] and own[1] == pytest.approx(max(raw[1] - est, 0.2 * raw[1]))
            assert own[1] < raw[1]
        else:
            assert own == raw
        before = n
