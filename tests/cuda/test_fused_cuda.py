"""The fused RMSNorm on CUDA (redraft.models.fused): one kernel where transformers' module
launches eight, and the same values to the last place of bf16 (F.rms_norm may sum the squares
in another order than ``pow().mean()``)."""

import pytest
import torch
from cuda_helpers import DEVICE
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from redraft.models.fused import fused_rms_norm_forward

pytestmark = pytest.mark.cuda


def _kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_norm_launches_fewer_kernels_and_gives_the_same_values(dtype):
    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(576, 1e-5).to(DEVICE, dtype)
    norm.weight.data = (torch.randn(576, generator=g) * 0.5 + 1).to(DEVICE, dtype)
    x = (torch.randn(64, 40, 576, generator=g) * 3).to(DEVICE, dtype)
    with torch.no_grad():
        want = LlamaRMSNorm.forward(norm, x)
        got = fused_rms_norm_forward(norm, x)
        eps = torch.finfo(dtype).eps
        assert ((got.float() - want.float()).abs() <= 2 * eps * want.float().abs() + eps).all()
        differ = (got != want).float().mean().item()
        assert differ < 1e-3, differ  # the last place, in a handful of elements at most
        plain = _kernels(lambda: LlamaRMSNorm.forward(norm, x))
        fused = _kernels(lambda: fused_rms_norm_forward(norm, x))
    assert fused <= 2 < plain, (fused, plain)
