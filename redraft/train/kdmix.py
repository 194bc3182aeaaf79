"""Main records plus KD-only records (``--kd-features`` cached, ``--kd-data`` online), as one
record source.

The KD-only records are any text the target has read once (``redraft-cache-features`` over plain
ShareGPT, say: a forward pass per token, where a self-distilled reply costs a generation step per
token). Their labels are someone else's words, but the cached top-k teacher at every token is
the target's own next-token distribution for that context, which is what the head must predict.
So their rows carry no loss mask (no cross-entropy) and ``kd_rows`` (the KL term counts on every
real token, :func:`redraft.train.step.kd_positions_mask`).

Online (``--kd-data``) the target reads them each step like the main records and its LM head
gives the teacher. Record indices ``[0, len(main))`` are the main records, the rest the KD-only ones; an epoch
(:func:`redraft.train.batches.epoch_batches` over :attr:`lengths`) shuffles both together.
"""

from __future__ import annotations

import numpy as np
import torch

from redraft.errors import ConfigError, FingerprintMismatchError
from redraft.train.batches import Batch
from redraft.train.features import FeatureRecords
from redraft.train.fingerprint import describe, record_mismatch


def _pad_cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """``[B_i, T_i, ...]`` tensors -> ``[sum B_i, max T_i, ...]`` (zeros after each row's end)."""
    if any(p is None for p in parts):
        return None
    T = max(p.shape[1] for p in parts)
    out = parts[0].new_zeros((sum(p.shape[0] for p in parts), T, *parts[0].shape[2:]))
    row = 0
    for p in parts:
        out[row : row + p.shape[0], : p.shape[1]] = p
        row += p.shape[0]
    return out


class KDOnlyMix:
    """``main`` records plus the KD-only records ``extra``, one record source: two
    :class:`FeatureRecords` (:meth:`of_features`, ``--kd-features``) or two token sources
    (:class:`redraft.train.batches.TokenRecords`, ``--kd-data``: the target reads both online)."""

    def __init__(self, main, extra):
        self.main, self.extra = main, extra
        self.n_main = len(main)
        self.lengths = np.concatenate([main.lengths, extra.lengths])
        self.kd_tokens = int(extra.lengths.sum())

    @classmethod
    def of_features(cls, main: FeatureRecords, path, record: dict) -> KDOnlyMix:
        """``main`` and the KD-only features in ``path``, checked to come from the same target
        (fingerprints) with the same feature layout."""
        extra = FeatureRecords(path, load_topk=True)
        saved = extra.meta["target"]
        if record_mismatch(saved, record):
            raise FingerprintMismatchError(
                f"--kd-features {path} were cached from target {describe(saved)}, but this run's "
                f"target is {describe(record)}; cache them with this run's target "
                f"(redraft-cache-features --target ...)."
            )

        def layout(r: FeatureRecords) -> str:
            return (
                f"width {r.hidden_size}, layers {list(r.hidden_layers) or 'last'}, "
                f"{r.hidden_dtype}, top-{r.top_k}"
            )

        if layout(extra) != layout(main):
            raise ConfigError(
                f"--kd-features {path} hold features of {layout(extra)}, --features "
                f"{main.path} of {layout(main)}; cache both with the same --head-features, "
                f"--feature-layers, --hidden-dtype and --top-k.",
                param="kd_features",
            )
        return cls(main, extra)

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(self, idx, device) -> Batch:
        """Records ``idx`` (main rows first, then the KD-only ones: order does not change a loss)."""
        idx = np.asarray(idx, dtype=np.int64)
        mine, extra = idx[idx < self.n_main], idx[idx >= self.n_main] - self.n_main
        parts, kd_rows = [], []
        if len(mine):  # put together on the CPU, moved once (no device read for loss_tokens)
            parts.append(self.main.batch(mine, "cpu"))
            kd_rows.append(torch.zeros(len(mine), dtype=torch.bool))
        if len(extra):
            b = self.extra.batch(extra, "cpu")
            b.mask.zero_()  # their labels are not the target's words: no cross-entropy
            parts.append(b)
            kd_rows.append(torch.ones(len(extra), dtype=torch.bool))
        mask = _pad_cat([p.mask for p in parts])
        return Batch(
            ids=_pad_cat([p.ids for p in parts]),
            mask=mask,
            tokens=sum(p.tokens for p in parts),
            loss_tokens=int(mask[:, 2:].sum()),
            hidden=_pad_cat([p.hidden for p in parts]),
            topk_ids=_pad_cat([p.topk_ids for p in parts]),
            topk_logits=_pad_cat([p.topk_logits for p in parts]),
            lengths=torch.cat([p.lengths for p in parts]),
            kd_rows=torch.cat(kd_rows),
        ).to(device)

    def token_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The main records' ``(input_ids, loss_mask)``: the draft vocabulary is the most frequent
        tokens of the target's replies, not of the KD-only text."""
        return self.main.token_arrays()
