"""Prefill forwards as one flattened row of the pieces' tokens, no padding (CPU).

A padded prefill forward of prompts of different lengths runs every row to the longest one:
``rows x T`` tokens through every linear layer where the prompts hold far fewer. Here the
pieces' tokens are one row, each at its own position (``starts[b] + i``); the cache's update
writes each row's keys and values into its own slot (:class:`~redraft.infer.runner.kv.Ragged`)
and the attention attends each row over its own slot
(:func:`~redraft.infer.runner.grouped_attention.ragged_sdpa`), so the forward costs exactly the
pieces' tokens and its linears run on all of them at once. The values are the padded forward's
up to float32 rounding.
"""

from __future__ import annotations

import torch

from redraft.infer.runner.grouped_attention import with_ragged
from redraft.infer.runner.kv import SlotKVCache


def prefill_ragged(
    model,
    prompts: list[list[int]],
    cache: SlotKVCache,
    first_slot: int = 0,
    starts: list[int] | None = None,
) -> torch.Tensor:
    """``Verifier.prefill`` as one flattened row: piece ``b`` (``prompts[b]``, after the
    ``starts[b]`` tokens its row holds, default 0) into slot ``first_slot + b``; returns each
    row's hidden state after its last piece token ``[n, F]``. ``model(ids, positions, mask,
    cache)`` is the verifier's forward (``Verifier._model``), run under redraft's attention."""
    dev = cache.kv.device
    starts = list(starts or [0] * len(prompts))
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    ragged = cache.begin_ragged(starts, lens, first_slot)
    # a 4D mask is passed on as it is (transformers builds none); each row's own mask, where it
    # needs one, is made by the attention
    bias = torch.zeros((1, 1, 1, 1), dtype=cache.kv.dtype, device=dev)
    try:
        with with_ragged(ragged):
            hid = model(ids[None].to(dev), pos[None].to(dev), bias, cache)[0]  # [tokens, F]
    finally:
        cache.ragged = None
    last = torch.tensor([o + n - 1 for o, n in zip(ragged.offsets, lens)], device=dev)
    return hid[last]
