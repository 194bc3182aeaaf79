"""Sibling linears run as one product (redraft.models.siblings): the siblings a forward
traces, each kernel's output, the measured choice at 1-2 tokens."""

import pytest
import torch

from redraft.models import cpu, siblings

pytestmark = pytest.mark.skipif(not cpu.packing_available(), reason="torch built without oneDNN")


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
    return siblings.sibling_groups(m, lambda: m(input_ids=ids, use_cache=False), min_weight=0)


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
def test_each_kernel_gives_each_sibling_its_columns_and_really_runs():
    m = _llama()
    groups = _groups(m)
    for g in groups:
        g.kernel = {1: "fused", 2: "linear"}
        g.make(fused=True)
    one, two, three = torch.tensor([[5]]), torch.tensor([[5, 9]]), torch.tensor([[5, 9, 2]])
    refs = [m(input_ids=x).last_hidden_state for x in (one, two, three)]
    with cpu.use_packed({}, groups=groups):
        got = [m(input_ids=x).last_hidden_state for x in (one, two, three)]
    torch.testing.assert_close(got[0], refs[0], atol=1e-5, rtol=1e-5)  # fused
    assert torch.equal(got[1], refs[1])  # 2 rows: linear, the model's own kernel
    torch.testing.assert_close(got[2], refs[2], atol=1e-5, rtol=1e-5)  # 3 rows: packed
    assert all(g._last is None for g in groups)  # no input or output held after the block
    assert all("forward" not in x.__dict__ for g in groups for x in g.layers)
    # k's columns of the group's weights doubled: k's output doubles in the kernel that ran
    qkv, k = groups[0], groups[0].layers[1]
    x1 = m.layers[0].input_layernorm(m.embed_tokens(one))  # what the first k_proj gets
    x3 = m.layers[0].input_layernorm(m.embed_tokens(three))
    w = torch.cat([x.weight for x in qkv.layers])
    w[32:48] *= 2
    qkv.wt, qkv.packed = w.T.contiguous(), cpu.pack_weight(w)
    for ids, x in ((one, x1), (three, x3)):
        seen = {}
        hook = k.register_forward_hook(lambda mod, args, out: seen.setdefault("k", out))
        with cpu.use_packed({}, groups=groups):
            m(input_ids=ids)
        hook.remove()
        want = 2 * torch.nn.functional.linear(x, k.weight)
        torch.testing.assert_close(seen["k"], want, atol=1e-5, rtol=1e-5)


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
    assert siblings._fastest(ways, repeats=2, clock=lambda: now[0]) == {1: "fused", 2: "packed"}


def test_fused_weights_are_kept_only_where_the_fused_kernel_won(monkeypatch):
    m = _llama()
    picks = iter([{1: "linear", 2: "packed"}] * 4 + [{1: "fused", 2: "linear"}] * 4)
    monkeypatch.setattr(siblings, "_time_kernels", lambda *a: next(picks))
    groups = _groups(m)
    siblings.plan_small_rows(groups)  # four shapes, timed once each
    assert all(g.wt is None and g.kernel == {1: "linear", 2: "packed"} for g in groups)
    assert all(g.packed is not None for g in groups)  # every group runs 3 rows and more packed
    with torch.no_grad():
        m.layers[0].self_attn.q_proj.weight.mul_(1.0)  # a weight changed: planned again
        m.layers[0].mlp.gate_proj.weight.mul_(1.0)
        m.layers[0].self_attn.o_proj.weight.mul_(1.0)
        m.layers[0].mlp.down_proj.weight.mul_(1.0)
    groups = _groups(m)
    siblings.plan_small_rows(groups)
    assert all(g.kernel == {1: "fused", 2: "linear"} for g in groups)
    w = groups[0].wt
    assert torch.equal(w, torch.cat([x.weight for x in groups[0].layers]).T) and w.is_contiguous()
    again = _groups(m)
    siblings.plan_small_rows(again)
    assert again[0].wt is w  # one copy, shared by every plan over these layers
    assert "1 token: fused 8" in siblings.describe(again)[0]
