"""Device functions replayed from a graph per shape (ShapeGraphs), and the ReDrafter beam search
through it: the same results as the eager function, new input values reach every replay, and
a failed capture changes nothing. CPU tests inject a capture that replays by re-running the
captured function over its static buffers (as a CUDA graph re-runs its kernels over them)."""

import contextlib
import logging

import pytest
import torch

from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.redrafter.drafter import ReDrafterDrafter, beam_search
from redraft.infer.runner.graphs import ShapeGraphs


def replaying_capture(captured):
    def capture(fn, device, pool):
        out = fn()

        class Graph:
            def replay(self):
                out.copy_(fn())

        captured.append(out)
        return Graph(), out

    return capture


def failing_capture(fn, device, pool):
    raise RuntimeError("operation not permitted when stream is capturing")


def test_a_shape_is_captured_on_its_second_call_in_a_row_and_replays_new_values():
    calls = []

    def fn(key, x, y):
        calls.append(key)
        return x * key + y

    captured = []
    g = ShapeGraphs(fn, "cpu", replaying_capture(captured), enabled=True)
    x, y = torch.arange(4.0), torch.ones(4)
    assert g(2, x, y).tolist() == [1, 3, 5, 7]  # first call: eager
    assert g(3, x, y).tolist() == [1, 4, 7, 10]  # another key: eager, nothing captured
    assert not captured and g.stats["eager"] == 2
    assert g(3, x, 2 * y).tolist() == [2, 5, 8, 11]  # second in a row: captured, replayed
    assert len(captured) == 1 and (g.stats["captures"], g.stats["replays"]) == (1, 1)
    out = g(3, x + 1, y)  # replays read the new values through the static buffers
    assert out.tolist() == [4, 7, 10, 13] and out is captured[0]
    assert g(2, x, y).tolist() == [1, 3, 5, 7] and g.stats["replays"] == 2  # eager again
    assert g.stats["eager"] == 3


def test_shapes_that_alternate_are_captured_on_their_third_use():
    """A speculating engine's tree size changes from step to step: "the second call in a row"
    alone never captured those shapes (a third of a distillation run's steps stayed eager)."""
    captured = []
    g = ShapeGraphs(lambda key, x: x * key, "cpu", replaying_capture(captured), enabled=True)
    x = torch.ones(2)
    for key in (2, 3, 2, 3):
        assert g(key, x).tolist() == [float(key)] * 2
    assert not captured and g.stats["eager"] == 4
    assert g(2, x).tolist() == [2.0, 2.0] and len(captured) == 1  # third use of 2: captured
    assert g(3, x).tolist() == [3.0, 3.0] and len(captured) == 2
    assert g(2, x + 1).tolist() == [4.0, 4.0] and g.stats["replays"] == 3
    assert g.stats["eager"] == 4 and g.store.uses == {}  # a captured key is not counted on


def test_a_failed_capture_leaves_the_result_and_runs_that_shape_eagerly(caplog):
    g = ShapeGraphs(lambda key, x: x + key, "cpu", failing_capture, enabled=True)
    x = torch.zeros(3)
    with caplog.at_level(logging.WARNING, logger="redraft.infer.runner.graphs"):
        outs = [g(1, x).tolist() for _ in range(4)]
    assert outs == [[1.0] * 3] * 4
    assert g.stats["failed"] == 1 and g.stats["eager"] == 4 and 1 in g.eager
    assert sum("capture" in r.message for r in caplog.records) == 1  # logged once


def test_the_beam_search_replayed_equals_the_eager_one_for_new_inputs(tiny_target, tiny_head):
    captured = []
    dr = ReDrafterDrafter(tiny_head, width=3, length=4, capture=replaying_capture(captured))
    assert dr.graphs.enabled is False  # a CPU head: no graphs unless asked
    dr.graphs.enabled = True
    H, V = tiny_head.config.hidden_size, tiny_target.vocab_size
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        ctx = torch.randn(2, H, generator=g)
        last = torch.randint(0, V, (2,), generator=g)
        both = dr.search(ctx, last, 3, 4).clone()
        tokens, logp, _ = beam_search(dr.head, ctx, last, 3, 4)
        assert both.shape == (2, 3, 8)
        assert both[..., :4].long().tolist() == tokens.tolist(), i
        torch.testing.assert_close(both[..., 4:].float(), logp)
    assert dr.graphs.stats["captures"] == 1 and dr.graphs.stats["replays"] == 3


def test_decoding_with_the_beam_search_replayed_is_plain_greedy(
    tiny_target, tiny_head, tiny_prompts
):
    ref = plain_greedy(tiny_target, tiny_prompts, max_new_tokens=20)
    out = {}
    for graphs in (False, True):
        dr = ReDrafterDrafter(tiny_head, width=4, length=3, capture=replaying_capture([]))
        dr.graphs.enabled = graphs
        dec = SpeculativeDecoder(tiny_target, [dr], budget=12)
        out[graphs] = dec.generate(tiny_prompts, max_new_tokens=20)
        assert [o.tokens for o in out[graphs]] == [r.tokens for r in ref]
        assert (dr.graphs.stats["replays"] > 0) == graphs
    # the same drafts either way: the same acceptance, step by step
    for a, b in zip(out[False], out[True]):
        assert a.stats.accepted_hist == b.stats.accepted_hist
        assert a.stats.target_calls == b.stats.target_calls


def test_at_most_max_graphs_are_kept_the_least_recently_replayed_dropped():
    captured = []
    g = ShapeGraphs(lambda key, x: x + key, "cpu", replaying_capture(captured), True, max_graphs=2)
    x = torch.zeros(2)
    for key in (1, 1, 2, 2, 1, 3, 3):  # 1 and 2 captured; 1 replayed again; 3 drops 2
        assert g(key, x).tolist() == [float(key)] * 2
    assert list(g.entries) == [1, 3] and g.stats["dropped"] == 1 and len(captured) == 3
    assert g(2, x).tolist() == [2.0, 2.0] and g.stats["captures"] == 3  # eager again, then ...
    assert g(2, x).tolist() == [2.0, 2.0] and list(g.entries) == [3, 2]  # ... 1 dropped


def test_a_full_store_captures_only_shapes_used_twice_in_a_row():
    """At ``max_graphs`` a shape that merely recurs (its third use, not in a row) stays eager:
    no churn of captures and drops; one used twice in a row still displaces the oldest."""
    captured = []
    g = ShapeGraphs(lambda key, x: x + key, "cpu", replaying_capture(captured), True, max_graphs=2)
    x = torch.zeros(1)
    for key in (1, 1, 2, 2):
        g(key, x)
    assert list(g.entries) == [1, 2]
    for key in (3, 4, 3, 4, 3, 4):  # third uses of 3 and 4, never in a row
        assert g(key, x).tolist() == [float(key)]
    assert len(captured) == 2 and g.stats["dropped"] == 0
    g(4, x)  # 4 twice in a row: captured, 1 (least recently replayed) dropped
    assert list(g.entries) == [2, 4] and g.stats["dropped"] == 1


def test_a_capture_runs_with_the_cyclic_garbage_collector_off(monkeypatch):
    """A collection in mid-capture can destroy a dead decoder's graphs, which a capturing stream
    does not permit (the capture then fails): cuda_capture turns the cyclic
    collector off for the capture and back on after it, also when the capture raises."""
    import gc

    from redraft.infer.runner import graphs

    seen = []

    class FakeGraph:
        pass

    class FakeCapture:
        def __init__(self, graph, pool=None):
            pass

        def __enter__(self):
            seen.append(("enter", gc.isenabled()))

        def __exit__(self, *exc):
            seen.append(("exit", gc.isenabled()))

    class FakeStream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    assert gc.isenabled()
    calls = []
    graph, out = graphs.cuda_capture(lambda: calls.append(gc.isenabled()) or 7, "cuda", None)
    assert out == 7 and isinstance(graph, FakeGraph)
    assert calls == [True, True, False]  # two warm-ups with it on, the captured call with it off
    assert seen == [("enter", False), ("exit", False)] and gc.isenabled()

    def boom():
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError):
        with graphs.no_cyclic_gc():
            boom()
    assert gc.isenabled()
    gc.disable()
    try:  # off before: stays off
        with graphs.no_cyclic_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
