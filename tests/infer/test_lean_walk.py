"""The lean walk over a Llama target's layers (redraft.models.lean) gives transformers' forward
bit for bit, and keeps transformers' forward for what it does not know."""

import pytest
import torch

from redraft.infer.runner.step_input import StepInput, chain_step
from redraft.infer.runner.verify import Verifier
from redraft.models import cpu, lean

pytestmark = pytest.mark.skipif(not cpu.packing_available(), reason="torch built without oneDNN")


@pytest.fixture(scope="module")
def wide_target(tmp_path_factory):
    """A random Llama wide enough that its linears are traced as sibling groups (the walk runs
    over those: q/k/v and gate/up one product each)."""
    from redraft.models import load_target
    from redraft.testing import make_tiny_target_dir

    path = make_tiny_target_dir(tmp_path_factory.mktemp("wide"), hidden_size=512, num_layers=2)
    return load_target(str(path), dtype="float32", device="cpu")


def _tree_step(lengths: list[int]) -> StepInput:
    """Per row a tree of 4 nodes: root 0; 1 and 2 children of 0; 3 a child of 1."""
    parent = [-1, 0, 0, 1]
    depth = [0, 1, 1, 2]
    anc = torch.zeros(4, 4, dtype=torch.long)
    for i in range(4):
        j = i
        while j >= 0:
            anc[i, j] = 1
            j = parent[j]
    rows = []
    for b, n in enumerate(lengths):
        tokens = [(11 * b + 5 * i + 3) % 300 for i in range(4)]
        rows.append(torch.tensor([n, *tokens, *depth, *parent, *anc.flatten().tolist()]))
    return StepInput(torch.stack(rows), 4)


@torch.inference_mode()
def _run(v: Verifier) -> list[torch.Tensor]:
    """Prefill two rows of different lengths, then verify a tree and chains of 1, 2 and 6
    tokens (the 1-2 token kernels measured per shape, the packed ones from 3)."""
    prompts = [[(7 * j + 1) % 300 for j in range(23)], [(5 * j + 2) % 300 for j in range(9)]]
    cache = v.new_cache(2, 64)
    outs = [v.prefill(prompts, cache)]
    lengths = [len(p) for p in prompts]
    cache.batch, cache.host_lengths = 2, lengths
    for step in (_tree_step(lengths), *(chain_step(lengths, n, v.device, 17) for n in (1, 2, 6))):
        h = v.verify(step, cache)
        outs += [h.clone(), v.logits(h)]
    return outs


def test_the_walk_gives_transformers_forward_bit_for_bit(wide_target):
    walk, hf = Verifier(wide_target), Verifier(wide_target, lean_walk=False)
    assert walk._lean is not None and hf._lean is None
    assert len(walk._lean.layers) == 2
    for layers in ((), (0, 1)):  # the last layer's state; with a multi-layer head's states
        walk.hidden_layers = hf.hidden_layers = layers
        got, want = _run(walk), _run(hf)
        assert len(got) == len(want) == 9
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(a, b)
        if layers:
            assert got[1].shape[-1] == 3 * wide_target.hidden_size


@torch.inference_mode()
def test_a_prefill_piece_in_the_verify_forward_is_walked_bit_for_bit(wide_target):
    """Chunked prefill's piece rides in the verify forward (one flattened row, the cache and the
    attention take the parts apart): the walk gives what transformers' forward gives."""
    long = [(3 * j + 4) % 300 for j in range(15)]
    outs = []
    for v in (Verifier(wide_target), Verifier(wide_target, lean_walk=False)):
        cache = v.new_cache(4, 64)
        v.prefill([long[:7], long[2:11]], cache)
        cache.batch, cache.host_lengths = 2, [7, 9]
        v.prefill([long[:6]], cache, first_slot=3)  # a row being prefilled, 6 tokens in
        hidden, last = v.verify_with_piece(_tree_step([7, 9]), cache, [long[6:15]], 3, [6])
        outs.append((hidden, last, cache.kv.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_the_walk_really_runs(wide_target, monkeypatch):
    """The verifier's forwards go through the walk, not transformers' forward (which the walk
    is compared with above): a broken walk must change the output."""
    walk = Verifier(wide_target)
    want = _run(walk)
    monkeypatch.setattr(walk._lean, "rope", lambda x, cos, sin: x)  # the walk's only
    got = _run(walk)
    assert not torch.equal(got[1], want[1])


def test_the_walk_keeps_transformers_forward_for_what_it_does_not_know(wide_target):
    from redraft.models import siblings

    base = wide_target.model.model
    groups = siblings.traced_groups(base)
    assert lean.LeanForward.build(base, groups) is not None
    assert lean.LeanForward.build(base, []) is None  # no sibling groups traced
    assert lean.LeanForward.build(base, groups[1:]) is None  # q/k/v not one group
    handle = base.layers[1].mlp.register_forward_hook(lambda *a: None)
    try:  # a hook would not run inside the walk
        assert lean.LeanForward.build(base, groups) is None
        assert Verifier(wide_target)._lean is None
    finally:
        handle.remove()
    handle = base.layers[0].self_attn.k_proj.register_forward_pre_hook(lambda *a: None)
    try:
        assert lean.LeanForward.build(base, groups) is None
    finally:
        handle.remove()


def test_another_architecture_keeps_transformers_forward():
    from transformers import MistralConfig, MistralModel

    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=64,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    from redraft.models import siblings

    base = MistralModel(cfg).eval()
    groups = siblings.traced_groups(base)
    assert len(groups) == 4  # the same siblings, but not the Llama code the walk replays
    assert lean.LeanForward.build(base, groups) is None
