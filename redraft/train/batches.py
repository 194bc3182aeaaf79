"""Training records, their order, and micro batches.

A *record source* is what the loop draws micro batches from; two kinds exist:

* :class:`TokenRecords`: a token dataset (``redraft.data.build_token_dataset``: columns
  ``input_ids``, ``loss_mask``); the target computes the hidden states on the fly;
* :class:`~redraft.train.features.FeatureRecords`: features cached by
  ``redraft-cache-features`` (the same records plus the target's hidden states and top-k logits).

Both expose ``lengths`` ([N] tokens per record), ``batch(idx, device) -> Batch`` and
``token_arrays() -> (ids, mask)``. The order of the records is :func:`epoch_batches`, a pure
function of (seed, epoch), so a resumed run and every rank see the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from redraft.errors import ConfigError, DataError


@dataclass
class Batch:
    """One micro batch, right padded.

    Attributes:
        ids: ``[B, T]`` token ids (0 on padding).
        mask: ``[B, T]`` 1 on assistant tokens (the loss mask), 0 elsewhere and on padding.
        tokens: real (unpadded) tokens, a host int.
        loss_tokens: assistant tokens a window can learn (``mask[:, 2:].sum()``), a host int.
        hidden: ``[B, T, H]`` the target's last hidden states when cached, else None.
        topk_ids, topk_logits: ``[B, T, k]`` the target's top-k next-token ids / logits when
            cached, else None.
        lengths: ``[B]`` real tokens per row (``kd_positions: all`` counts those), or None.
        kd_rows: ``[B]`` bool, rows whose KL term counts on every real token whatever
            ``kd_positions`` says (``--kd-features`` records: :mod:`redraft.train.kdmix`), or None.
        host: the same batch on the CPU when this one was moved to another device
            (:meth:`to`): the loss picks its windows there, so a micro step never waits for
            the device to say how many positions it has (``nonzero`` on CUDA syncs).
    """

    ids: torch.Tensor
    mask: torch.Tensor
    tokens: int
    loss_tokens: int
    hidden: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logits: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    kd_rows: torch.Tensor | None = None
    host: Batch | None = None

    def to(self, device) -> Batch:
        """This (CPU) batch on ``device`` (copies issued without waiting), keeping this one as
        :attr:`host`; itself on the CPU."""
        device = torch.device(device)
        if device.type == "cpu":
            return self

        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        return Batch(
            ids=move(self.ids),
            mask=move(self.mask),
            tokens=self.tokens,
            loss_tokens=self.loss_tokens,
            hidden=move(self.hidden),
            topk_ids=move(self.topk_ids),
            topk_logits=move(self.topk_logits),
            lengths=move(self.lengths),
            kd_rows=move(self.kd_rows),
            host=self,
        )


def _data_kwargs(cfg) -> dict:
    """``build_token_dataset`` settings every dataset of a run shares."""
    return dict(
        max_length=cfg.max_length,
        pack=cfg.pack,
        heldout_fraction=cfg.heldout_fraction,
        num_proc=cfg.num_proc,
        cache_dir=cfg.data_cache_dir,
    )


def _rank0_first(env, build):
    """``build()`` on rank 0 first (it fills the tokenized cache), then on the other ranks."""
    if not env.is_main:
        env.barrier()
    out = build()
    if env.is_main:
        env.barrier()
    return out


def load_datasets(cfg, tokenizer, env, train: bool = True):
    """(train, heldout) token datasets from redraft.data; rank 0 tokenizes first (the cache).
    With ``train=False`` only the held-out set is built (train is None)."""
    from redraft.data import build_token_dataset

    common = _data_kwargs(cfg)

    def build():
        tr = (
            build_token_dataset(cfg.data, tokenizer, split="train", limit=cfg.train_limit, **common)
            if train
            else None
        )
        if cfg.eval_data:
            held = build_token_dataset(
                cfg.eval_data, tokenizer, split="all", limit=cfg.eval_limit, **common
            )
        else:
            held = build_token_dataset(
                cfg.data, tokenizer, split="heldout", limit=cfg.eval_limit, **common
            )
        return tr, held

    return _rank0_first(env, build)


def load_kd_dataset(cfg, tokenizer, env):
    """The ``--kd-data`` records (their train split, at most ``kd_limit``) as a token dataset."""
    from redraft.data import build_token_dataset

    return _rank0_first(
        env,
        lambda: build_token_dataset(
            cfg.kd_data, tokenizer, split="train", limit=cfg.kd_limit, **_data_kwargs(cfg)
        ),
    )


def check_dataset(ds, what: str):
    """``ds`` itself, after checking it has ``input_ids``/``loss_mask`` and at least one row."""
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise DataError(
            f"The {what} dataset lacks the column(s) {sorted(missing)}; it needs input_ids and "
            f"loss_mask (redraft.data.build_token_dataset)."
        )
    if len(ds) == 0:
        raise DataError(
            f"The {what} dataset is empty; check the data spec and --train-limit/--eval-limit."
        )
    return ds


def sequence_lengths(ds) -> np.ndarray:
    """Tokens per record of a token dataset, ``[N]`` int64 (from Arrow, no Python loop)."""
    import pyarrow.compute as pc

    return pc.list_value_length(ds.with_format("arrow")["input_ids"]).to_numpy().astype(np.int64)


def draft_vocab_from_tokens(
    ids: np.ndarray, mask: np.ndarray, vocab_size: int, size: int
) -> torch.Tensor:
    """The ``size`` most frequent ids among the tokens where ``mask`` is set. [size] long.

    ``ids``, ``mask``: flat ``[N]`` arrays of every record's tokens.
    """
    counts = np.bincount(ids[mask.astype(bool)].astype(np.int64), minlength=vocab_size)[:vocab_size]
    # ties broken by id so every rank picks the same set; never-seen ids fill up the tail
    order = np.lexsort((np.arange(vocab_size), -counts))
    return torch.from_numpy(order[:size].copy())


def token_arrays(ds) -> tuple[np.ndarray, np.ndarray]:
    """Flat ``(input_ids [N], loss_mask [N])`` of every record of a token dataset."""
    import pyarrow.compute as pc

    tbl = ds.with_format("arrow")
    return (
        pc.list_flatten(tbl["input_ids"]).to_numpy(),
        pc.list_flatten(tbl["loss_mask"]).to_numpy(),
    )


def draft_vocab_from_data(ds, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids among the assistant (loss-masked) tokens of ``ds``."""
    return draft_vocab_from_tokens(*token_arrays(ds), vocab_size, size)


def epoch_batches(
    lengths: np.ndarray, global_batch: int, seed: int, epoch: int, group_by_length: bool
) -> np.ndarray:
    """The global batches of one epoch: ``[num_batches, global_batch]`` record indices.

    A deterministic function of (seed, epoch), so a resumed run sees the same order. With
    ``group_by_length`` records are sorted by length inside shuffled chunks of 32 batches
    (less padding) and the batches are shuffled again.
    """
    n = len(lengths)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n)
    nb = n // global_batch
    if nb == 0:
        raise ConfigError(
            f"The training set has {n} records, fewer than one global batch "
            f"(micro_batch_size x grad_accum x processes = {global_batch}); lower them.",
            param="micro_batch_size",
        )
    order = order[: nb * global_batch]
    if group_by_length and global_batch > 1:
        chunk = global_batch * 32
        parts = [
            c[np.argsort(-lengths[c], kind="stable")]
            for c in np.array_split(order, max(1, len(order) // chunk))
        ]
        order = np.concatenate(parts)
        batches = order.reshape(nb, global_batch)
        return batches[rng.permutation(nb)]
    return order.reshape(nb, global_batch)


def micro_batch(
    global_batch: np.ndarray, k: int, rank: int, world_size: int, size: int
) -> np.ndarray:
    """Record indices of this rank's ``k``-th micro batch of a global batch.

    Micro batch ``j`` of the global batch goes to rank ``j % world``: 2 processes with
    accumulation ``a`` see exactly the micro batches of 1 process with accumulation ``2a``.
    """
    j = rank + world_size * k
    return global_batch[j * size : (j + 1) * size]


def pad_rows(rows, dtype=torch.long) -> torch.Tensor:
    """Right-pad a list of 1-D sequences with zeros: ``[B, max len]``."""
    T = max(len(r) for r in rows)
    out = torch.zeros(len(rows), T, dtype=dtype)
    for b, r in enumerate(rows):  # B rows, not tokens
        out[b, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def collate(ds, idx, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``idx`` -> right-padded ``input_ids`` [B, T] and ``loss_mask`` [B, T] (0 on padding)."""
    rows = ds[[int(i) for i in idx]]
    return pad_rows(rows["input_ids"]).to(device), pad_rows(rows["loss_mask"]).to(device)


class TokenRecords:
    """Record source over a token dataset: the target computes hidden states on the fly."""

    def __init__(self, ds):
        self.ds = check_dataset(ds, "training")
        self.lengths = sequence_lengths(ds)

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(self, idx, device) -> Batch:
        rows = self.ds[[int(i) for i in idx]]
        ids, mask = pad_rows(rows["input_ids"]), pad_rows(rows["loss_mask"])
        return Batch(
            ids,
            mask,
            tokens=int(self.lengths[idx].sum()),
            loss_tokens=int(mask[:, 2:].sum()),
            lengths=torch.as_tensor(self.lengths[idx], dtype=torch.long),
        ).to(device)

    def token_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return token_arrays(self.ds)
