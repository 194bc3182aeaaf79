"""Per-row sampling of HSDDW's drafts: each row's warped distribution, draws and uniforms from
the row's own generator (greedy rows take the argmax)."""

from __future__ import annotations

import torch

from redraft.infer.spec.accept import RowSampling, warp_probs


def _draft_probs(logits: torch.Tensor, samp: RowSampling) -> torch.Tensor:
    """``[B, ..., V]`` draft distributions at each row's temperature and top-p (the target's
    warping, ``warp_probs``). Greedy rows are at temperature 1 without top-p: their entropy is
    what self-verify reads; their tokens are the argmax either way."""
    t = samp.temperature.to(logits.device)
    sampled = t > 0
    temp = torch.where(sampled, t, torch.ones_like(t))
    top_p = (
        torch.where(sampled, samp.top_p.to(logits.device), torch.ones_like(t))
        if samp.any_top_p
        else 1.0
    )
    return warp_probs(logits, temp, top_p)


def _by_generator(samp: RowSampling, B: int, draw):
    """Run ``draw(rows or None, generator)`` once per generator of the batch (``rows``: the
    ``[n]`` long rows sharing it; ``None``: all of them) and put the results in row order."""
    if len(samp.groups) == 1:
        return draw(None, samp.groups[0][0])
    out = None
    for gen, idx in samp.groups:
        rows = torch.tensor(idx, device=samp.temperature.device)
        part = draw(rows, gen)
        if out is None:
            out = part.new_empty((B, *part.shape[1:]))
        out[rows.to(part.device)] = part
    return out


def _draw(probs: torch.Tensor, greedy: torch.Tensor, samp: RowSampling) -> torch.Tensor:
    """One token per row: ``greedy [B]`` for greedy rows, else a sample of ``probs [B, V]`` from
    the row's generator."""
    if samp.all_greedy:
        return greedy
    drawn = _by_generator(
        samp,
        probs.shape[0],
        lambda rows, gen: torch.multinomial(
            probs if rows is None else probs[rows.to(probs.device)], 1, generator=gen
        )[:, 0],
    )
    return torch.where(samp.temperature.to(probs.device) > 0, drawn, greedy)


def _uniform(samp: RowSampling, B: int, R: int, device) -> torch.Tensor:
    """``[B, R]`` uniform draws, each row's from its generator."""
    return _by_generator(
        samp,
        B,
        lambda rows, gen: torch.rand(
            (B if rows is None else rows.numel(), R), generator=gen, device=device
        ),
    )
