"""Fewer kernels per target forward, the same numbers: the RMSNorm as one PyTorch op.

transformers' ``LlamaRMSNorm`` (and Mistral's, Qwen2's, Qwen3's: the same code) runs as up to 8
separate ops (cast up, ``pow``, ``mean``, ``add``, ``rsqrt``, ``mul``, cast down, ``mul``): on
a GPU each is a kernel launch, 61 norms x 8 = 488 of the 1,356 kernels of SmolLM2-135M's bf16
forward (eager on a GPU the module takes ~9x as long as
``F.rms_norm``). :func:`fuse_rms_norms` gives each such module the forward

    weight * F.rms_norm(x, eps)

which is the same arithmetic in the same precision: ``F.rms_norm`` normalises in float32 and
rounds once to the model's dtype, then the weight scales it in that dtype (the order
transformers uses; putting the weight inside ``F.rms_norm`` would round once instead of twice
and move ~1 bf16 ulp in a quarter of the elements). On the CPU it is bit-exact against
transformers' module (float32, bfloat16, float16: 30M elements each, measured with torch 2.13;
``tests/models/test_fused.py``); on CUDA ``F.rms_norm`` may sum the squares in another order
(float32 rounding, below the model dtype's precision). Two kernels instead of eight.

A class is fused only if one of its modules passes a check on its own device and dtype when the
target loads (random inputs of three scales, 4,096 rows: the fused output equal to the original's
bit for bit): a norm of another formula (Gemma's ``1 + weight``) fails it and keeps its own
forward, and so does a device whose ``F.rms_norm`` rounds differently. That happens: on a GPU
(torch 2.11, CUDA 13) float32 ``F.rms_norm`` differed from transformers' module by more than two
units of the last place in some elements, and bfloat16 was identical in 1.5M elements of one
input and not of another. A target in float32 is what people compare with
transformers' own output, so it keeps transformers' numbers there. Decoding is exact either way:
plain and speculative decoding run the same model.
"""

from __future__ import annotations

import copy
import logging
import types

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# transformers' classes whose forward is LlamaRMSNorm's (checked again at load)
FUSABLE = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def fused_rms_norm_forward(self, hidden: torch.Tensor) -> torch.Tensor:
    return self.weight * F.rms_norm(hidden, self.weight.shape, eps=self.variance_epsilon)


@torch.no_grad()
def _agrees(module) -> bool:
    """Whether the fused forward gives the module's own output bit for bit on random inputs of
    its device and dtype (4,096 rows at three scales: one norm op each, at load). Many rows:
    where the two round differently they agree in most elements (bfloat16 on a GPU passed a
    check of 64 rows, then differed in some elements of a 2,560-row input)."""
    if module.weight.device.type == "meta":  # no values to compute with: check a CPU copy
        module = copy.deepcopy(module).to_empty(device="cpu")
        module.weight.data.uniform_(0.5, 1.5)
    w = module.weight
    g = torch.Generator(device="cpu").manual_seed(0)
    for scale in (0.01, 3.0, 30.0):
        x = (torch.randn(4096, w.shape[-1], generator=g) * scale).to(w.device, w.dtype)
        want = type(module).forward(module, x)
        got = fused_rms_norm_forward(module, x)
        if want.shape != got.shape or want.dtype != got.dtype or not torch.equal(want, got):
            return False
    return True


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Give every RMSNorm of :data:`FUSABLE` classes in ``model`` the fused forward (its instance
    attribute; the class is untouched). Returns how many modules were fused."""
    checked: dict[type, bool] = {}
    n = 0
    for module in model.modules():
        cls = type(module)
        if cls.__name__ not in FUSABLE or not hasattr(module, "variance_epsilon"):
            continue
        if cls not in checked:
            checked[cls] = _agrees(module)
            if not checked[cls]:
                log.info("%s: its output differs from F.rms_norm's; left as it is", cls.__name__)
        if checked[cls]:
            module.forward = types.MethodType(fused_rms_norm_forward, module)
            n += 1
    return n
