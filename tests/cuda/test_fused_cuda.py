"""The fused RMSNorm on CUDA (redraft.models.fused): one kernel where transformers' module
launches eight, and the same values to the last place of bf16 (F.rms_norm may sum the squares
in another order than ``pow().mean()``)."""

import pytest
import torch
from cuda_helpers import DEVICE
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from redraft.models.fused import fuse_rms_norms, fused_rms_norm_forward

pytestmark = pytest.mark.cuda


def _kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")


def test_the_fused_norm_launches_fewer_kernels_and_gives_the_same_values_in_bf16():
    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(576, 1e-5).to(DEVICE, torch.bfloat16)
    norm.weight.data = (torch.randn(576, generator=g) * 0.5 + 1).to(DEVICE, torch.bfloat16)
    x = (torch.randn(64, 40, 576, generator=g) * 3).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        want = LlamaRMSNorm.forward(norm, x)
        got = fused_rms_norm_forward(norm, x)
        assert torch.equal(got, want)  # bfloat16: identical on the GPUs measured
        plain = _kernels(lambda: LlamaRMSNorm.forward(norm, x))
        fused = _kernels(lambda: fused_rms_norm_forward(norm, x))
    assert fused <= 2 < plain, (fused, plain)
    assert fuse_rms_norms(torch.nn.Sequential(norm)) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_norm_on_cuda_gives_transformers_numbers_bit_for_bit(dtype):
    """Whatever ``fuse_rms_norms`` decides on this device and dtype, a fused norm's output equals
    transformers' (float32 on a GPU may differ by a few ulps: it must stay unfused there)."""
    g = torch.Generator().manual_seed(1)
    norm = LlamaRMSNorm(576, 1e-5).to(DEVICE, dtype)
    norm.weight.data = (torch.randn(576, generator=g) * 0.5 + 1).to(DEVICE, dtype)
    x = (torch.randn(64, 40, 576, generator=g) * 3).to(DEVICE, dtype)
    with torch.no_grad():
        want = LlamaRMSNorm.forward(norm, x)
        fused = fuse_rms_norms(torch.nn.Sequential(norm))
        got = norm(x)
    print(f"{dtype}: fused {fused}")
    assert torch.equal(got, want)
