"""Faster float32 CPU linears (redraft.models.cpu): oneDNN-packed weights for multi-token
forwards, sibling layers fused at 1-2 tokens."""

import pytest
import torch

from redraft.models import cpu

pytestmark = pytest.mark.skipif(not cpu.packing_available(), reason="torch built without oneDNN")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 32, bias=False)
    )


@torch.no_grad()
def test_packed_forwards_match_and_the_model_is_left_as_it_was():
    m = _model()
    packs = cpu.pack_linears(m, min_weight=0)
    assert len(packs) == 2
    x = torch.randn(2, 5, 48)  # 10 rows: the packed path
    ref = m(x)
    with cpu.use_packed(packs):
        got = m(x)
        one = m(x[:1, :1])  # one row: the default kernel, bit for bit
        assert "forward" in m[0].__dict__
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(one, m(x[:1, :1]))
    # the packed path really ran: a packed weight that differs changes the output
    bad = {layer: cpu.pack_weight(layer.weight * 2) for layer in packs}
    with cpu.use_packed(bad):
        assert not torch.allclose(m(x), ref, atol=1e-3)
    assert "forward" not in m[0].__dict__ and "forward" not in m[2].__dict__
    torch.testing.assert_close(m(x), ref, atol=0, rtol=0)


def test_use_packed_restores_instance_forwards_and_leaves_training_alone():
    m = _model()
    packs = cpu.pack_linears(m, min_weight=0)
    hooked = m[0].forward = lambda x: torch.zeros(x.shape[:-1] + (96,))  # e.g. an accelerate hook
    with cpu.use_packed(packs):
        pass
    assert m[0].forward is hooked
    del m[0].forward
    x = torch.randn(6, 48, requires_grad=True)
    with cpu.use_packed(packs):
        m(x).sum().backward()  # inputs that need grad take the default kernel: gradients flow
    assert x.grad is not None and m[0].weight.grad is not None


def test_nothing_to_pack_in_bfloat16():
    assert cpu.pack_linears(_model().to(torch.bfloat16)) == {}


@torch.no_grad()
def test_head_weights_are_shared_and_remade_when_the_weight_changes():
    head = torch.nn.Linear(16, 40, bias=False)
    wt, packed = cpu.head_weights(head, torch.float32, min_weight=0)
    assert torch.equal(wt, head.weight.T) and wt.is_contiguous()
    x = torch.randn(5, 16)
    torch.testing.assert_close(cpu.packed_linear(x, packed, None), head(x), atol=1e-5, rtol=1e-5)
    assert cpu.head_weights(head, torch.float32, min_weight=0)[0] is wt  # made once
    head.weight.mul_(2)  # in place: the derived copies must follow
    wt2, packed2 = cpu.head_weights(head, torch.float32, min_weight=0)
    assert torch.equal(wt2, head.weight.T)
    torch.testing.assert_close(cpu.packed_linear(x, packed2, None), head(x), atol=1e-5, rtol=1e-5)
    assert (
        cpu.head_weights(head, torch.bfloat16)[1] is None
        and cpu.head_weights(head, torch.bfloat16)[0].dtype == torch.bfloat16
    )


def test_packing_starts_at_the_fewest_rows_where_it_is_measured_to_win():
    """``_fastest_from`` times 1 and 2 rows both ways (a fake clock: each call adds its cost)."""
    now = [0.0]

    def cost(table):  # rows -> seconds
        def call(x):
            now[0] += table[x.shape[0]]

        return call

    def pick(default, packed):
        calls = [(4, cost(default), cost(packed))] * 3
        return cpu._fastest_from(calls, repeats=2, clock=lambda: now[0])

    assert pick({1: 1.0, 2: 2.0}, {1: 1.2, 2: 1.2}) == 2  # an AVX-512 CPU: the 2-row GEMM is slow
    assert pick({1: 1.0, 2: 2.0}, {1: 0.9, 2: 1.0}) == 1
    assert pick({1: 1.0, 2: 1.1}, {1: 1.3, 2: 1.4}) == cpu.MIN_PACKED_ROWS  # an AMX CPU
    assert pick({1: 1.0, 2: 1.1}, {1: 0.5, 2: 1.4}) == cpu.MIN_PACKED_ROWS  # ranges start low


@torch.no_grad()
def test_use_packed_takes_the_rows_it_is_given():
    m = _model()
    packs = cpu.pack_linears(m, min_weight=0)
    x = torch.randn(1, 48)
    bad = {layer: cpu.pack_weight(layer.weight * 2) for layer in packs}
    with cpu.use_packed(bad):  # one row: the default kernel
        torch.testing.assert_close(m(x), _model()(x), atol=0, rtol=0)
    with cpu.use_packed(bad, rows=(1, 128)):  # from one row: the packed weights
        assert not torch.allclose(m(x), _model()(x), atol=1e-3)


def test_the_packing_threshold_is_measured_once_per_layer_set(monkeypatch):
    """``packed_from`` times the layers once and remembers the answer (until a weight changes);
    with nothing packed it is the default threshold, untimed."""
    timed = []
    monkeypatch.setattr(cpu, "_fastest_from", lambda calls, repeats: timed.append(calls) or 2)
    m = _model()
    packs = cpu.pack_linears(m, min_weight=0)
    assert cpu.packed_from({}) == cpu.MIN_PACKED_ROWS and timed == []
    assert cpu.packed_from(packs) == 2 and cpu.packed_from(packs) == 2
    assert len(timed) == 1 and len(timed[0]) == 2  # both layers, in forward order
    with torch.no_grad():
        m[0].weight.mul_(1.0)  # an in-place update: the answer is measured again
    assert cpu.packed_from(packs) == 2 and len(timed) == 2


def _llama():
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaModel(cfg).eval()


def _groups(m):
    ids = torch.tensor([[3]])
    return cpu.sibling_groups(m, lambda: m(input_ids=ids, use_cache=False), min_weight=0)


def test_sibling_groups_are_the_linears_called_with_one_input():
    m = _llama()
    got = [[name for name, x in m.named_modules() if x in g.layers] for g in _groups(m)]
    want = []
    for i in range(2):
        a, p = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        want += [[f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"], [f"{a}.o_proj"]]
        want += [[f"{p}.gate_proj", f"{p}.up_proj"], [f"{p}.down_proj"]]
    assert got == want
    g = _groups(m)[0]
    assert g.bounds == [(0, 32), (32, 48), (48, 64)]  # q: 4 heads x 8, k and v: 2 x 8


@torch.no_grad()
def test_the_fused_kernel_gives_each_sibling_its_columns_and_really_runs():
    m = _llama()
    groups = _groups(m)
    for g in groups:
        g.kernel = {1: "fused", 2: "fused"}
        g.make_fused()
    one, three = torch.tensor([[5]]), torch.tensor([[5, 9, 2]])
    ref1, ref3 = m(input_ids=one).last_hidden_state, m(input_ids=three).last_hidden_state
    with cpu.use_packed({}, groups=groups):
        got1 = m(input_ids=one).last_hidden_state
        got3 = m(input_ids=three).last_hidden_state  # 3 rows: the default kernel
    torch.testing.assert_close(got1, ref1, atol=1e-5, rtol=1e-5)
    assert torch.equal(got3, ref3)
    assert all(g._last is None for g in groups)  # no input or output held after the block
    assert all("forward" not in x.__dict__ for g in groups for x in g.layers)
    q, k = groups[0].layers[:2]
    groups[0].wt = groups[0].wt.clone()
    groups[0].wt[:, 32:48] *= 2  # k's columns of the fused weight
    with cpu.use_packed({}, groups=groups):
        seen = {}
        hook = k.register_forward_hook(lambda mod, args, out: seen.setdefault("k", out))
        m(input_ids=one)
        hook.remove()
    x = m.layers[0].input_layernorm(m.embed_tokens(one))  # what the first layer's k_proj got
    torch.testing.assert_close(seen["k"], 2 * torch.nn.functional.linear(x, k.weight))


def test_the_fastest_kernel_is_picked_per_row_count():
    now = [0.0]

    def way(costs):  # rows -> seconds
        def call(n):
            now[0] += costs[n]

        return call

    ways = {
        "linear": way({1: 2.0, 2: 4.0}),
        "packed": way({1: 2.5, 2: 2.2}),
        "fused": way({1: 1.2, 2: 2.6}),
    }
    assert cpu._fastest(ways, repeats=2, clock=lambda: now[0]) == {1: "fused", 2: "packed"}


def test_fused_weights_are_kept_only_where_the_fused_kernel_won(monkeypatch):
    m = _llama()
    picks = iter([{1: "linear", 2: "packed"}] * 4 + [{1: "fused", 2: "linear"}] * 4)
    monkeypatch.setattr(cpu, "_time_kernels", lambda *a: next(picks))
    groups = _groups(m)
    cpu.plan_small_rows(groups, {})  # four shapes, timed once each
    assert all(g.wt is None and g.kernel == {1: "linear", 2: "packed"} for g in groups)
    with torch.no_grad():
        m.layers[0].self_attn.q_proj.weight.mul_(1.0)  # a weight changed: planned again
        m.layers[0].mlp.gate_proj.weight.mul_(1.0)
        m.layers[0].self_attn.o_proj.weight.mul_(1.0)
        m.layers[0].mlp.down_proj.weight.mul_(1.0)
    groups = _groups(m)
    cpu.plan_small_rows(groups, {})
    assert all(g.kernel == {1: "fused", 2: "linear"} for g in groups)
    w = groups[0].wt
    assert torch.equal(w, torch.cat([x.weight for x in groups[0].layers]).T) and w.is_contiguous()
    again = _groups(m)
    cpu.plan_small_rows(again, {})
    assert again[0].wt is w  # one copy, shared by every plan over these layers
    assert "1 token: fused 8" in cpu.describe(again)[0]
