"""The decode step's device budget and its graph capture, checked on the CPU.

* ops per step: tensor ops a step dispatches outside the target forward (each one a kernel
  launch on a GPU) stay within a budget of a few dozen;
* CUDA-graph capture: a capture that fails leaves that shape eager with one warning and the
  output unchanged; captured graphs are replayed, reused across requests and dropped with their
  pool when the cache buffer grows (a fake capture replays the forward on the static buffers, so
  the same code path runs on the CPU).
"""

import logging

import pytest
import torch

from redraft.errors import ConfigError
from redraft.infer.config import SamplingParams
from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.ngram import ContextNGramDrafter, NGrammysDrafter
from redraft.infer.runner.cost import CostCurve
from redraft.infer.runner.kv import SlotKVCache
from redraft.infer.runner.opcount import OpCounter

CURVE = CostCurve([1, 8, 64], [1.0, 1.1, 1.5])

# the budget: plain greedy <= 10 ops per step, N-Grammys <= 60 at batch 1 and 8
BUDGET = {"greedy": 10, "ngrammys": 60}


@pytest.fixture(scope="module")
def overhead_setup(tmp_path_factory):
    from redraft.bench.overhead import tiny_setup

    return tiny_setup(tmp_path_factory.mktemp("ops"))


@pytest.mark.parametrize("method", ["greedy", "ngrammys"])
@pytest.mark.parametrize("batch", [1, 8])
def test_a_step_dispatches_few_ops_outside_the_forward(overhead_setup, method, batch):
    from redraft.bench.overhead import _prompts, make_method

    target, tables = overhead_setup
    dec = make_method(method, target, tables)
    dec.eos = set()
    eng = dec.engine()
    for p in _prompts(target, batch):
        eng.add(p, SamplingParams.checked(max_new_tokens=48))
    for _ in range(4):  # joins, the cost curve, warm caches
        eng.step()
    counts = []
    for _ in range(6):
        with OpCounter() as ops:
            eng.step()
        counts.append(ops.total)
        assert ops.host_reads <= 1  # CPU: no device reads to count; the contract is one per step
    assert max(counts) <= BUDGET[method], (counts, ops.by_name.most_common(8))
    assert min(counts) >= 2  # the LM head and the rule's pick are always there: the counter counts


def test_the_counter_skips_the_forward_and_view_ops():
    from redraft.infer.runner.opcount import not_counted

    x = torch.arange(12.0).reshape(3, 4)
    with OpCounter() as ops:
        y = x.view(4, 3).T[0]  # views only
        with not_counted():
            x @ x.T
        z = y + 1
    assert ops.total == 1 and ops.by_name["add"] == 1 and z.shape == (4,)


class FakeGraph:
    """Replays the captured function on its static buffers (what a CUDA graph does)."""

    def __init__(self, fn, out):
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self):
        self.out.copy_(self.fn())
        self.replays += 1


def fake_capture(captures):
    def capture(fn, device, pool):
        out = fn()
        g = FakeGraph(fn, out)
        captures.append(g)
        return g, out

    return capture


def _static_decoder(target, capture, drafters):
    dec = SpeculativeDecoder(target, drafters, budget=8, cost_curve=CURVE, static_verify=True)
    dec.verifier.graphs = True
    dec.verifier.capture = capture
    return dec


def test_replayed_graphs_give_plain_greedy_and_are_reused_across_requests(
    tiny_target, tiny_tables, tiny_prompts
):
    V = tiny_target.vocab_size
    captures = []
    dec = _static_decoder(
        tiny_target,
        fake_capture(captures),
        [NGrammysDrafter(tiny_tables, V), ContextNGramDrafter(V)],
    )
    keys, capture_key = [], dec.verifier._capture  # which shape each capture was for

    def spy(key, *a):
        keys.append(key)
        return capture_key(key, *a)

    dec.verifier._capture = spy
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=30)
    out = dec.generate(tiny_prompts, max_new_tokens=30)
    assert [g.tokens for g in out] == [g.tokens for g in ref]
    assert captures and sum(g.replays for g in captures) > 0
    n = len(captures)
    stats = dec.verifier.graph_stats  # what redraft-bench reports
    assert stats["captures"] == n and stats["failed"] == 0 and stats["capture_s"] > 0
    assert stats["replays"] == sum(g.replays for g in captures)
    steps = sum(g.stats.verify_steps for g in out)
    assert stats["eager"] > 0 and stats["replays"] + stats["eager"] <= steps  # rows share steps
    again = dec.generate(tiny_prompts, max_new_tokens=30)  # the same engine, cache and graphs
    assert [g.tokens for g in again] == [g.tokens for g in ref]
    # nothing captured twice (a shape first met often enough by the second generate is captured then)
    assert len(captures) == len(keys) == len(set(keys)) >= n
    assert stats["captures"] == len(captures)
    assert stats["replays"] == sum(g.replays for g in captures)


def test_a_failing_capture_warns_once_and_decoding_goes_on_eagerly(
    tiny_target, tiny_tables, tiny_prompts, caplog
):
    attempts = []

    def broken(fn, device, pool):
        attempts.append(1)
        fn()  # half-way through a capture, like CUBLAS_STATUS_EXECUTION_FAILED on a GPU
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    dec = _static_decoder(
        tiny_target, broken, [NGrammysDrafter(tiny_tables, tiny_target.vocab_size)]
    )
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=30)
    with caplog.at_level(logging.WARNING, logger="redraft.infer.runner.verify"):
        out = dec.generate(tiny_prompts, max_new_tokens=30)
    assert [g.tokens for g in out] == [g.tokens for g in ref]
    warnings = [r for r in caplog.records if "capture" in r.getMessage()]
    assert len(warnings) == 1 and "eagerly" in warnings[0].getMessage()
    eng = dec._engine
    assert attempts and len(eng.cache.graph_set.eager) == len(attempts)  # each shape tried once
    stats = dec.verifier.graph_stats
    assert stats["failed"] == len(attempts) and stats["captures"] == stats["replays"] == 0


def test_growing_the_cache_drops_its_graphs_and_their_pool(tiny_target, tiny_tables, tiny_prompts):
    captures = []
    dec = _static_decoder(
        tiny_target, fake_capture(captures), [NGrammysDrafter(tiny_tables, tiny_target.vocab_size)]
    )
    eng = dec.engine()
    eng.add(dec.encode(tiny_prompts[2])[0], SamplingParams.checked(max_new_tokens=20))
    for _ in range(6):
        eng.step()
    graphs = eng.cache.graph_set
    assert len(graphs) >= 1
    gen = eng.cache.generation
    eng.add(
        dec.encode(tiny_prompts[1])[0], SamplingParams.checked(max_new_tokens=400)
    )  # more slots and columns
    eng.step()
    assert eng.cache.generation > gen
    while eng.has_work:
        eng.step()
    assert graphs.generation == eng.cache.generation  # stale graphs were dropped, new ones made


@pytest.mark.parametrize("batch", [1, 8])
def test_a_redrafter_step_costs_its_beam_search_and_auto_adds_no_ops(overhead_setup, batch):
    """The beam search dispatches a fixed number of ops per draft step, whatever the width and
    batch (beams are batched); an "auto" width and length plans on the host: once its beam-cost
    measurement is done, a step runs exactly the ops of a fixed search of the chosen size."""
    from redraft.bench.overhead import _prompts
    from redraft.infer.drafters.redrafter.drafter import ReDrafterDrafter
    from redraft.models.redrafter import ReDrafter, ReDrafterConfig

    target, _ = overhead_setup
    torch.manual_seed(0)
    head = ReDrafter(ReDrafterConfig.for_target(target, num_layers=1)).eval()
    head.attach_target(target)

    def step_ops(width, length):
        dr = ReDrafterDrafter(head, width=width, length=length)
        dec = SpeculativeDecoder(target, [dr], guard=False)
        dec.eos = set()
        eng = dec.engine()
        for p in _prompts(target, batch):
            eng.add(p, SamplingParams.checked(max_new_tokens=48))
        for _ in range(4):  # joins, the cost curves, the first plan
            eng.step()
        out = []
        for _ in range(6):
            with OpCounter() as ops:
                eng.step()
            out.append((ops.total, dr.length))
        return out

    fixed = {n: {c for c, _ in step_ops(8, n)} for n in (1, 3, 5)}
    assert all(len(c) == 1 for c in fixed.values())  # the same every step
    per = {n: c.pop() for n, c in fixed.items()}
    assert per[5] - per[3] == per[3] - per[1] <= 2 * 30  # each draft step: <= 30 ops
    assert per[1] <= 40
    assert step_ops(2, 3)[0][0] == per[3]  # width does not add ops
    for total, length in step_ops("auto", "auto"):
        assert total == per[1] + (length - 1) * (per[3] - per[1]) // 2


def test_the_cost_curve_is_the_envelope_from_the_right_and_keeps_what_was_measured(monkeypatch):
    """A size measured dearer than a larger one (a noisy run, or a kernel slow at 2 rows) does
    not price every size after it: c(n) = min over m >= n of the measured times."""
    from redraft.infer.runner import cost as budget

    cost = {1: 1.0, 2: 3.0, 4: 1.2, 8: 1.1, 16: 1.5}  # seconds per forward of n tokens
    clock = {"t": 0.0}
    monkeypatch.setattr(budget.time, "perf_counter", lambda: clock["t"])

    def forward(n):
        clock["t"] += cost[n]

    curve = budget.measure_cost_curve(forward, sizes=list(cost), repeats=2)
    assert curve.seconds.tolist() == pytest.approx([1.0, 1.1, 1.1, 1.1, 1.5])
    assert curve.raw.tolist() == pytest.approx(list(cost.values()))
    again = CostCurve.from_ms(curve.to_dict())  # the JSON keeps both
    assert again.raw.tolist() == pytest.approx(list(cost.values()))
    assert again.seconds.tolist() == pytest.approx([1.0, 1.1, 1.1, 1.1, 1.5])
    plain = CostCurve([1, 8], [1.0, 2.0])
    assert "raw_ms" not in plain.to_dict() and plain.raw.tolist() == [1.0, 2.0]
    # work that cannot be padded (a beam search): the envelope from the left, as before
    beam = budget.measure_cost_curve(forward, sizes=list(cost), repeats=2, padded=False)
    assert beam.seconds.tolist() == pytest.approx([1.0, 3.0, 3.0, 3.0, 3.0])


def test_a_cost_curve_is_read_from_a_bench_json_with_its_raw_times(tmp_path):
    import json

    out = tmp_path / "bench.json"  # what redraft-bench --out writes
    out.write_text(
        json.dumps(
            {
                "cost_curve_ms": {
                    "sizes": [1, 2, 4],
                    "ms": [50, 50, 51],
                    "raw_ms": [50, 59, 51],
                    "given": False,
                }
            }
        )
    )
    curve = CostCurve.from_ms(str(out))
    assert curve.seconds.tolist() == pytest.approx([0.050, 0.050, 0.051])
    assert curve.raw.tolist() == pytest.approx([0.050, 0.059, 0.051])
    bare = tmp_path / "curve.json"
    bare.write_text(json.dumps({"sizes": [1, 8], "ms": [10, 20]}))
    assert CostCurve.from_ms(str(bare)).seconds.tolist() == pytest.approx([0.010, 0.020])


def test_a_tree_is_padded_to_a_larger_size_that_measured_cheaper(tiny_target):
    from redraft.infer.runner.verify import Verifier

    curve = CostCurve([1, 2, 4, 8, 16], [1.0, 1.1, 1.1, 1.1, 1.5], raw=[1.0, 3.0, 1.2, 1.1, 1.5])
    static = Verifier(tiny_target, static=True)
    assert static.tree_size(2) == 2  # no curve: the next static size
    assert static.tree_size(2, limit=65, curve=curve) == 8  # 1.1 s against 3.0 s
    assert static.tree_size(3, limit=65, curve=curve) == 8  # (pads to 4 first: 1.1 < 1.2 * 0.95)
    assert static.tree_size(2, limit=4, curve=curve) == 4  # the limit holds
    assert static.tree_size(8, limit=65, curve=curve) == 8  # nothing larger is cheaper
    assert static.tree_size(2, limit=65, curve=CostCurve([1, 8], [1.0, 2.0])) == 2
    dynamic = Verifier(tiny_target, static=False)
    assert dynamic.tree_size(3, limit=65, curve=curve) == 8  # interpolated 2.1 s at 3 tokens
    assert dynamic.tree_size(9, limit=65, curve=curve) == 9
    assert dynamic.tree_size(2, limit=65) == 2


def test_padded_trees_keep_plain_greedy_and_skip_the_dear_sizes(
    tiny_target, tiny_tables, tiny_prompts
):
    """Decoding with a curve whose 2- and 4-token forwards measured dear: no verify of those
    sizes runs (a drafter of one 3-token row proposes at most 3 nodes: trees of 2-4 are filled
    up to 8, with padding), and the output is plain greedy's."""
    V = tiny_target.vocab_size
    curve = CostCurve(
        [1, 2, 4, 8, 16, 32, 64],
        [1.0, 1.05, 1.05, 1.05, 3.0, 5.0, 9.0],
        raw=[1.0, 3.0, 3.0, 1.05, 3.0, 5.0, 9.0],
    )
    captures = []
    dec = SpeculativeDecoder(
        tiny_target,
        [NGrammysDrafter(tiny_tables, V, k=1, w=3)],
        cost_curve=curve,
        static_verify=True,
    )
    dec.verifier.graphs, dec.verifier.capture = True, fake_capture(captures)
    sizes, verify = [], dec.verifier.verify
    dec.verifier.verify = lambda step, cache: sizes.append(step.size) or verify(step, cache)
    for p in tiny_prompts:
        ref = plain_greedy(tiny_target, [p], max_new_tokens=30)
        assert [g.tokens for g in dec.generate([p], max_new_tokens=30)] == [ref[0].tokens]
    assert 8 in sizes and not {2, 4} & set(sizes)


def test_span_buckets_attend_over_the_longest_rows_bucket_and_keep_plain_greedy(
    tiny_target, tiny_tables, tiny_prompts
):
    """With ``span_buckets`` a captured verify attends over the shortest power-of-two span
    (>= 256) holding the longest row, not the whole capacity: a cache grown for a long request
    serves short rows with short spans, a graph per span, and the output is plain greedy's."""
    from redraft.infer.runner.verify import MIN_SPAN

    captures = []
    dec = SpeculativeDecoder(
        tiny_target,
        [NGrammysDrafter(tiny_tables, tiny_target.vocab_size)],
        budget=8,
        cost_curve=CURVE,
        static_verify=True,
        span_buckets=True,
    )
    dec.verifier.graphs, dec.verifier.capture = True, fake_capture(captures)
    spans = []
    begin = SlotKVCache.begin

    def spy(cache, lengths, n, span, rows=None):
        if rows is None:  # a verify forward (prefills pass their rows)
            spans.append((span, cache.capacity, cache.physical + n))
        return begin(cache, lengths, n, span, rows)

    SlotKVCache.begin = spy
    try:
        eng = dec.engine()
        long_prompt = dec.encode(tiny_prompts[1])[0] * 40  # a cache of > 1,000 columns
        eng.add(long_prompt[:700], SamplingParams.checked(max_new_tokens=400))
        short = [dec.encode(p)[0] for p in tiny_prompts]
        for p in short:
            eng.add(p, SamplingParams.checked(max_new_tokens=30))
        out = {}
        while eng.has_work:
            for ev in eng.step():
                if ev.done:
                    out[ev.index] = ev.generation
        capacity = eng.cache.capacity
        for p in short:  # the same cache, grown for the long request, now holds short rows only
            eng.add(p, SamplingParams.checked(max_new_tokens=30))
        while eng.has_work:
            for ev in eng.step():
                if ev.done:
                    out[ev.index] = ev.generation
    finally:
        SlotKVCache.begin = begin
    ref = plain_greedy(tiny_target, [long_prompt[:700]], max_new_tokens=400)
    ref += plain_greedy(tiny_target, short, max_new_tokens=30)
    ref += plain_greedy(tiny_target, short, max_new_tokens=30)
    assert [out[i].tokens for i in range(2 * len(short) + 1)] == [g.tokens for g in ref]
    assert eng.cache.capacity == capacity >= 1024
    assert spans and all(need <= span <= cap for span, cap, need in spans)
    assert all(
        span == cap or (span >= MIN_SPAN and span & (span - 1) == 0) for span, cap, _ in spans
    )
    assert min(s for s, _, _ in spans) < max(c for _, c, _ in spans)  # shorter than capacity
    assert sum(g.replays for g in captures) > 0
    # a graph per span: the long request's and the short rows' (the last ones at 256 columns)
    assert len({k[2] for k in eng.cache.graph_set.entries}) >= 2
    assert spans[-1][0] == MIN_SPAN


def test_span_buckets_follow_the_static_verify_unless_set(tiny_target):
    """``span_buckets: auto`` (the default) is on wherever the verify is static (CUDA), off
    otherwise; an explicit bool wins; anything else is refused naming the setting."""
    V = tiny_target.vocab_size

    def verifier(**kw):
        return SpeculativeDecoder(tiny_target, [ContextNGramDrafter(V)], budget=4, **kw).verifier

    assert verifier(static_verify=True).span_buckets is True
    assert verifier(static_verify=False).span_buckets is False  # CPU's default path too
    assert verifier().span_buckets is False and verifier().static is False  # auto on a CPU
    assert verifier(static_verify=True, span_buckets=False).span_buckets is False
    with pytest.raises(ConfigError, match="span_buckets"):
        verifier(span_buckets="sometimes")


def test_a_caches_graphs_are_capped_the_least_recently_replayed_dropped(
    tiny_target, tiny_tables, tiny_prompts
):
    """A server's batch sizes x tree sizes x spans are many shapes over its life: a cache keeps
    at most ``max_graphs`` of them, and decoding stays plain greedy's while it drops them."""
    captures = []
    dec = _static_decoder(
        tiny_target,
        fake_capture(captures),
        [
            NGrammysDrafter(tiny_tables, tiny_target.vocab_size),
            ContextNGramDrafter(tiny_target.vocab_size),
        ],
    )
    dec.verifier.max_graphs = 1
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=40)
    assert [g.tokens for g in dec.generate(tiny_prompts, max_new_tokens=40)] == [
        g.tokens for g in ref
    ]
    eng = dec._engine
    graphs = eng.cache.graph_set
    assert graphs.max_graphs == 1 and len(graphs) == 1
    # every capture past the first dropped one (the cache never grew: one generation)
    assert dec.verifier.graph_stats["dropped"] == graphs.dropped == len(captures) - 1 >= 1
