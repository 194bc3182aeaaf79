"""CUDA: the static-shape verify captured in CUDA graphs gives the eager path's output, with
rows of different lengths leaving the batch; graphs are really captured and replayed."""

import pytest

from redraft.infer.decoder import SpeculativeDecoder, plain_greedy
from redraft.infer.drafters.ngram import ContextNGramDrafter
from redraft.infer.runner.cost import CostCurve

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def cuda_target(tiny_target_dir):
    from redraft.models import load_target

    return load_target(str(tiny_target_dir), dtype="float32", device="cuda")


@pytest.mark.parametrize("budget", ["auto", 8])
def test_graph_verify_equals_eager_and_plain_greedy(cuda_target, tiny_prompts, budget):
    V = cuda_target.vocab_size
    curve = CostCurve([1, 8, 64], [1.0, 1.1, 1.5])
    ref = plain_greedy(cuda_target, tiny_prompts, max_new_tokens=40)
    outs = {}
    for mode in (False, True):
        dec = SpeculativeDecoder(
            cuda_target,
            [ContextNGramDrafter(V), ContextNGramDrafter(V, q=2, name="ctx2")],
            budget=budget,
            cost_curve=curve,
            static_verify=mode,
        )
        assert dec.verifier.graphs == mode
        outs[mode] = dec.generate(tiny_prompts, max_new_tokens=40)
    for a, b, r in zip(outs[False], outs[True], ref):
        assert a.tokens == b.tokens == r.tokens


def test_graphs_are_captured_and_replayed(cuda_target, tiny_prompts):
    dec = SpeculativeDecoder(
        cuda_target, [ContextNGramDrafter(cuda_target.vocab_size)], budget=8, static_verify=True
    )
    eng = dec.engine()
    eng.add(dec.encode(tiny_prompts[2])[0])
    for _ in range(6):
        eng.step()
    assert eng.cache is not None and len(eng.cache.graph_set) >= 1


def test_the_beam_search_is_replayed_from_graphs_and_decodes_as_eager(cuda_target, tiny_prompts):
    """On CUDA the ReDrafter beam search is captured per (rows, width, length) and replayed:
    its drafts equal the eager search's for new inputs, and decoding stays plain greedy."""
    import torch

    from redraft.infer.drafters.redrafter.drafter import ReDrafterDrafter, beam_search
    from redraft.models.redrafter import ReDrafter, ReDrafterConfig

    torch.manual_seed(0)
    head = ReDrafter(ReDrafterConfig.for_target(cuda_target, num_layers=1)).eval()
    head = head.attach_target(cuda_target).to("cuda")
    dr = ReDrafterDrafter(head, width=4, length=3)
    assert dr.graphs.enabled
    H, V = head.config.hidden_size, cuda_target.vocab_size
    for _ in range(4):
        ctx = torch.randn(3, H, device="cuda")
        last = torch.randint(0, V, (3,), device="cuda")
        both = dr.search(ctx, last, 4, 3).clone()
        tokens, logp, _ = beam_search(dr.head, ctx, last, 4, 3)
        assert both[..., :3].long().tolist() == tokens.tolist()
    assert dr.graphs.stats["captures"] == 1 and dr.graphs.stats["replays"] == 3
    ref = plain_greedy(cuda_target, tiny_prompts, max_new_tokens=24)
    dec = SpeculativeDecoder(cuda_target, [dr], budget=12, static_verify=True)
    out = dec.generate(tiny_prompts, max_new_tokens=24)
    assert [o.tokens for o in out] == [r.tokens for r in ref]
    assert dr.graphs.stats["failed"] == 0 and dr.graphs.stats["replays"] > 3


def test_a_collection_cannot_destroy_a_dead_graph_in_mid_capture():
    """A dead graph in a reference cycle, collected by an automatic collection that the captured
    call's own allocations trigger, must not break the capture (on a GPU: "operation not
    permitted when stream is capturing (function reset)", then the capture failed): cuda_capture
    keeps the cyclic collector off while it captures."""
    import gc

    import torch

    from redraft.infer.runner.graphs import cuda_capture

    dev = torch.device("cuda")
    x = torch.ones(16, device=dev)
    old, _ = cuda_capture(lambda: x * 2, dev, torch.cuda.graph_pool_handle())
    holder = {"graph": old}
    del old
    calls = []

    def fn():
        calls.append(1)
        if len(calls) == 3:  # the captured call: the old graph becomes cyclic garbage
            junk = [holder.pop("graph")]
            junk.append(junk)
            del junk
            for _ in range(2000):  # container allocations: a collection at every one
                [[]]  # noqa: B018
        return x + 1

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        graph, out = cuda_capture(fn, dev, torch.cuda.graph_pool_handle())
    finally:
        gc.set_threshold(*threshold)
    x.fill_(5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 6))
    gc.collect()  # the old graph goes now, outside any capture
