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
