"""The RMSNorm as one PyTorch op (redraft.models.fused): the same numbers, fewer ops, and a norm
of another formula left alone."""

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from redraft.models.fused import fuse_rms_norms, fused_rms_norm_forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_norm_is_bit_exact_against_transformers_on_the_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    for H in (64, 576):
        norm = LlamaRMSNorm(H, 1e-5).to(dtype)
        norm.weight.data = (torch.randn(H, generator=g) * 0.5 + 1).to(dtype)
        for scale in (0.01, 1.0, 30.0):
            x = (torch.randn(16, 9, H, generator=g) * scale).to(dtype)
            want = LlamaRMSNorm.forward(norm, x)
            got = fused_rms_norm_forward(norm, x)
            assert got.dtype == want.dtype == dtype
            assert torch.equal(got, want), (dtype, H, scale)


def test_a_loaded_target_has_fused_norms_and_the_same_logits(tmp_path):
    """load_target fuses every norm of the tiny target (a Llama); its logits are the ones of the
    same weights with transformers' norms, bit for bit. (On the CPU ``F.rms_norm`` runs as the
    same ops; the kernels it saves are CUDA's: tests/cuda/test_fused_cuda.py.)"""
    from redraft.models import load_target
    from redraft.testing import make_tiny_target_dir

    target = load_target(str(make_tiny_target_dir(tmp_path / "t", num_layers=2)), device="cpu")
    norms = [m for m in target.model.modules() if isinstance(m, LlamaRMSNorm)]
    assert len(norms) == 2 * 2 + 1 and all("forward" in vars(m) for m in norms)
    ids = torch.randint(0, target.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fused = target.model(ids).logits
    for m in norms:  # back to transformers' forward
        del m.forward
    with torch.no_grad():
        plain = target.model(ids).logits
    assert torch.equal(fused, plain)


def test_a_norm_of_another_formula_keeps_its_own_forward():
    class OnePlusRMSNorm(LlamaRMSNorm):  # Gemma's: x * (1 + weight)
        def forward(self, x):
            v = x.float().pow(2).mean(-1, keepdim=True)
            return (x.float() * torch.rsqrt(v + self.variance_epsilon) * (1 + self.weight)).to(
                x.dtype
            )

    OnePlusRMSNorm.__name__ = "Qwen2RMSNorm"  # a name on the list, another formula
    model = nn.Sequential(LlamaRMSNorm(8), OnePlusRMSNorm(8), LlamaRMSNorm(8))
    with torch.no_grad():
        model[0].weight.add_(0.5)
        model[1].weight.fill_(0.25)
    assert fuse_rms_norms(model) == 2
    assert "forward" in vars(model[0]) and "forward" in vars(model[2])
    assert "forward" not in vars(model[1])
    x = torch.randn(3, 8)
    assert torch.allclose(model[1](x), OnePlusRMSNorm.forward(model[1], x))


def test_a_norm_that_differs_in_the_last_place_keeps_its_own_forward():
    """Fusing is all or nothing on bit-exactness: a norm that sums its squares in another order
    (sequentially: a running sum) moves about a fifth of its outputs by up to two units of float32's
    last place, which a tolerance of two units would have let through; it is not fused, so a device
    whose ``F.rms_norm`` rounds differently keeps the model's numbers (float32 on a GPU
    did)."""

    class SequentialSumRMSNorm(LlamaRMSNorm):
        def forward(self, x):
            xf = x.float()
            v = (xf * xf).cumsum(-1)[..., -1:] / x.shape[-1]
            return self.weight * (xf * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype)

    SequentialSumRMSNorm.__name__ = "MistralRMSNorm"
    near = SequentialSumRMSNorm(576)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        want, got = near(x), fused_rms_norm_forward(near, x)
    eps = torch.finfo(torch.float32).eps
    assert not torch.equal(want, got)
    assert ((want - got).abs() <= 2 * eps * want.abs() + eps).all()  # within the old tolerance
    model = nn.Sequential(LlamaRMSNorm(576), near)
    assert fuse_rms_norms(model) == 1
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1])
