"""The ReDrafter drafter drafts in bfloat16 on CPUs that multiply it natively, else in the head's dtype."""

import torch

from redraft.infer.drafters.redrafter import drafter as rd
from redraft.models.redrafter import ReDrafter, ReDrafterConfig


def _head():
    return ReDrafter(ReDrafterConfig(hidden_size=8, vocab_size=32, num_layers=1, num_steps=3))


def test_auto_drafts_in_bf16_only_where_the_cpu_multiplies_bf16(monkeypatch):
    monkeypatch.setattr(rd, "native_bf16_cpu", lambda: True)
    assert rd.draft_dtype(_head()) == torch.bfloat16
    assert rd.draft_dtype(_head().to(torch.float16)) == torch.float16  # a half head stays as it is
    assert rd.draft_dtype(_head(), torch.float32) == torch.float32  # an explicit dtype wins
    monkeypatch.setattr(rd, "native_bf16_cpu", lambda: False)
    assert rd.draft_dtype(_head()) == torch.float32


def test_the_drafter_casts_its_head_and_proposes_target_ids(monkeypatch):
    monkeypatch.setattr(rd, "native_bf16_cpu", lambda: True)
    head = _head()
    head.attach_embeddings(torch.nn.Embedding(32, 8))
    drafter = rd.ReDrafterDrafter(head, width=2, length=3)
    assert next(drafter.head.parameters()).dtype == torch.bfloat16
    toks, logp, _ = rd.beam_search(drafter.head, torch.randn(2, 8), torch.tensor([1, 2]), 2, 3)
    assert toks.shape == (2, 2, 3) and toks.min() >= 0 and toks.max() < 32
    assert torch.all(logp <= 0)
