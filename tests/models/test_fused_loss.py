"""The fused (chunked) drafter loss equals the dense reference: loss, gradients, per-step stats."""

import pytest
import torch

from redraft.models.losses import drafter_loss, fused_drafter_loss, sparse_teacher


def _case(seed=0, P=7, n=3, D=6, V=11, k=4):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(P, n, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (P, n), generator=g)
    targets[0, 1] = -1  # outside the draft vocabulary: no CE, still KD
    valid = torch.rand(P, n, generator=g) > 0.3
    valid[:, 2] = False  # a step with nothing valid takes no part in the mean
    t_logits = torch.randn(P, n, k, generator=g, dtype=torch.float64)
    t_ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(P * n)]).view(P, n, k)
    t_ids[1, 0, :2] = -1  # two of the teacher's top-k are not draft ids
    t_ids[2, 1, :] = -1  # none is: that row has no KD term
    return feats, weight, targets, valid, t_ids, t_logits


def _dense_teacher(t_ids, t_logits, V):
    """Dense log-probs of the sparse teacher (most negative float where it has no mass)."""
    ids, probs = sparse_teacher(t_ids, t_logits)
    dense = torch.zeros(*ids.shape[:-1], V, dtype=torch.float64).scatter_add_(
        -1, ids, probs.double()
    )
    return torch.where(dense > 0, dense.clamp(min=1e-300).log(), torch.finfo(torch.float32).min)


@pytest.mark.parametrize("ce_w,kd_w", [(1.0, 0.0), (0.0, 1.0), (1.0, 0.5)])
@pytest.mark.parametrize("chunk_rows", [1, 4, 1000])
def test_fused_loss_and_gradients_equal_the_dense_reference(ce_w, kd_w, chunk_rows):
    feats, weight, targets, valid, t_ids, t_logits = _case()
    V = weight.shape[0]
    f1, w1 = feats.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = f1 @ w1.t()
    ref, ref_stats = drafter_loss(
        logits, targets, valid, _dense_teacher(t_ids, t_logits, V), ce_weight=ce_w, kd_weight=kd_w
    )
    ref.backward()
    f2, w2 = feats.clone().requires_grad_(), weight.clone().requires_grad_()
    ids, probs = sparse_teacher(t_ids, t_logits)
    out, stats = fused_drafter_loss(
        f2,
        w2,
        targets,
        valid,
        ids,
        probs.double(),
        ce_weight=ce_w,
        kd_weight=kd_w,
        chunk_rows=chunk_rows,
    )
    (out * 3).backward()  # the upstream gradient scales the stored ones
    torch.testing.assert_close(out.double(), ref.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(f2.grad, 3 * f1.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w2.grad, 3 * w1.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        stats["step_loss"].double(), ref_stats["step_loss"].double(), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(stats["step_count"], ref_stats["step_count"])
    top1 = (logits.argmax(-1) == targets) & valid & (targets >= 0)
    assert torch.equal(stats["top1"], top1)
    assert ref_stats["step_loss"][2] == 0 and stats["step_count"][2] == 0


def test_nothing_valid_gives_zero_loss_and_zero_gradients():
    feats, weight, targets, valid, *_ = _case()
    f, w = feats.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _ = fused_drafter_loss(f, w, targets, torch.zeros_like(valid))
    loss.backward()
    assert loss.item() == 0.0
    assert f.grad.abs().max() == 0 and w.grad.abs().max() == 0
    ref, _ = drafter_loss(f.detach() @ w.detach().t(), targets, torch.zeros_like(valid))
    assert ref.item() == 0.0


def test_fused_loss_under_bf16_autocast_is_close_to_fp32():
    feats, weight, targets, valid, *_ = _case(P=64, D=32, V=300)
    f = feats.float().requires_grad_()
    w = weight.float().requires_grad_()
    ref, _ = fused_drafter_loss(f, w, targets, valid)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp, _ = fused_drafter_loss(f, w, targets, valid, chunk_rows=50)
    amp.backward()
    assert w.grad.dtype == torch.float32 and f.grad.dtype == torch.float32
    assert abs(amp.item() - ref.item()) < 0.05 * abs(ref.item())


@pytest.mark.parametrize("decay", [1.0, 0.6])
def test_the_liger_wiring_gives_the_drafter_loss(monkeypatch, decay):
    """liger-kernel cannot run here (CUDA, Triton): a stand-in with its interface (mean CE over the
    rows that are not ignore_index, from the weight and the features) checks how redraft combines
    its per-step means into the drafter loss."""
    import sys
    import types

    import torch.nn.functional as F

    from redraft.train import liger

    class FakeLigerCE(torch.nn.Module):
        def __init__(self, ignore_index=-100, reduction="mean"):
            super().__init__()
            self.ignore_index, self.reduction = ignore_index, reduction

        def forward(self, lin_weight, _input, target):
            return F.cross_entropy(_input @ lin_weight.t(), target, ignore_index=self.ignore_index)

    fake = types.ModuleType("liger_kernel.transformers")
    fake.LigerFusedLinearCrossEntropyLoss = FakeLigerCE
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    feats, weight, targets, valid, *_ = _case()
    f1, w1 = feats.clone().requires_grad_(), weight.clone().requires_grad_()
    ref, ref_stats = drafter_loss(f1 @ w1.t(), targets, valid, step_decay=decay)
    ref.backward()
    f2, w2 = feats.clone().requires_grad_(), weight.clone().requires_grad_()
    out, stats = liger.liger_drafter_loss(f2, w2, targets, valid, decay)
    out.backward()
    torch.testing.assert_close(out.double(), ref.double())
    torch.testing.assert_close(w2.grad, w1.grad)
    torch.testing.assert_close(stats["step_loss"].double(), ref_stats["step_loss"].double())


@pytest.mark.parametrize("ce_w,kd_w", [(1.0, 0.0), (1.0, 0.5)])
def test_step_decay_weights_each_steps_mean_and_the_fused_loss_follows(ce_w, kd_w):
    """``step_decay`` d: step i's mean counts d**i, renormalised over the steps that have a
    position (here steps 0 and 1; step 2 has none): 1.25 and 0.75 at d = 0.6. The per-step
    stats stay the undecayed means, and the fused loss equals the dense one."""
    feats, weight, targets, valid, t_ids, t_logits = _case()
    V = weight.shape[0]
    teacher = _dense_teacher(t_ids, t_logits, V)
    logits = feats @ weight.t()
    kw = dict(ce_weight=ce_w, kd_weight=kd_w)
    plain, plain_stats = drafter_loss(logits, targets, valid, teacher, **kw)
    f1, w1 = feats.clone().requires_grad_(), weight.clone().requires_grad_()
    ref, ref_stats = drafter_loss(f1 @ w1.t(), targets, valid, teacher, step_decay=0.6, **kw)
    ref.backward()
    s = plain_stats["step_loss"].double()
    assert plain_stats["step_count"][2] == 0 and plain_stats["step_count"][:2].min() > 0
    torch.testing.assert_close(ref_stats["step_loss"], plain_stats["step_loss"])
    torch.testing.assert_close(ref.double(), (1.25 * s[0] + 0.75 * s[1]) / 2)
    torch.testing.assert_close(plain.double(), (s[0] + s[1]) / 2)
    assert abs(float(ref) - float(plain)) > 1e-3
    f2, w2 = feats.clone().requires_grad_(), weight.clone().requires_grad_()
    ids, probs = sparse_teacher(t_ids, t_logits)
    out, stats = fused_drafter_loss(
        f2, w2, targets, valid, ids, probs.double(), chunk_rows=4, step_decay=0.6, **kw
    )
    out.backward()
    torch.testing.assert_close(out.double(), ref.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(f2.grad, f1.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        stats["step_loss"].double(), ref_stats["step_loss"].double(), rtol=1e-5, atol=1e-6
    )
