"""oneDNN-packed float32 linears for multi-token CPU forwards (redraft.models.cpu)."""

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


def test_padding_table_pads_to_the_cheapest_row_count_at_or_above_and_only_past_the_margin():
    secs = {2: 10.0, 3: 9.5, 4: 6.0, 5: 6.5, 6: 7.0, 7: 9.0, 8: 8.5}
    # 2 and 3 run as 4; 5 and 6 have nothing cheaper above; 7 -> 8 saves only 5.6%
    assert cpu.padding_table(secs) == {2: 4, 3: 4}
    assert cpu.padding_table({**secs, 8: 5.0}) == {m: 8 for m in range(2, 8)}
    assert cpu.padding_table({2: 1.0, 3: 2.0, 4: 3.0}) == {}  # rising: never padded


@torch.no_grad()
@pytest.mark.parametrize("lead", [(2,), (1, 2), (2, 1), (3,)])
def test_padded_packed_products_give_each_rows_own_output(monkeypatch, lead):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    packed = cpu.pack_weight(layer.weight)
    x = torch.randn(*lead, 64)
    monkeypatch.setitem(cpu._ROW_PAD, torch.get_num_threads(), {2: 5, 3: 8})
    assert cpu.row_padding() == {2: 5, 3: 8}
    out = cpu.packed_linear(x, packed, layer.bias)
    assert out.shape == (*lead, 48)
    torch.testing.assert_close(out, layer(x), atol=1e-5, rtol=1e-5)
    # each row as it would be alone (the zero rows change nothing)
    for i, row in enumerate(x.reshape(-1, 64)):
        alone = cpu.packed_linear(row[None], packed, layer.bias)[0]
        torch.testing.assert_close(out.reshape(-1, 48)[i], alone, atol=1e-5, rtol=1e-5)


def test_plan_row_padding_measures_once_per_thread_count(monkeypatch):
    monkeypatch.setattr(cpu, "_ROW_PAD", {})
    calls = []

    def fake(packs, repeats):
        calls.append(len(packs))
        return {2: 10.0, 3: 6.0, 4: 7.0, 5: 8.0, 6: 9.0, 7: 9.5, 8: 9.9}

    monkeypatch.setattr(cpu, "_fastest_rows", fake)
    m = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Linear(256, 16))
    assert cpu.plan_row_padding(m) == {2: 3}
    assert calls == [1]  # the small layer stays out (below MIN_PACKED_WEIGHT)
    assert cpu.plan_row_padding(m) == {2: 3} and calls == [1]  # measured once
    assert cpu.plan_row_padding(torch.nn.Linear(4, 4)) == {2: 3}  # per thread count, not model
