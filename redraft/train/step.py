"""The math of one micro batch: the target's features, the head's loss, held-out metrics.

hidden   = target_hidden(target, ids)              [B, T, F]  (or cached: batch.hidden; F = H, or
                                                   k*H for a multi-layer head's k layers)
windows  = make_windows(ids, mask, n[, kd_mask])   P positions x n steps (losses.py; kd_mask: every
                                                   real token with ``kd_positions: all``)
feats    = head features(hidden[windows], tokens)  [P, n, S+H] every position, every step, one pass
teacher  = the target's top-k at each target       [P, n, k]  (only for the KD loss)
loss     = fused_drafter_loss(feats, O, targets, valid, teacher)
           (the output layer O [Vd, S+H] applied chunk by chunk: the [P, n, Vd] logits are
           never held; ``loss_impl: dense`` computes them and calls drafter_loss instead)
"""

from __future__ import annotations

import math

import numpy as np
import torch

from redraft.errors import ConfigError
from redraft.models.losses import fused_drafter_loss, sparse_teacher
from redraft.models.redrafter import ReDrafter
from redraft.train.batches import Batch, collate, sequence_lengths
from redraft.train.config import TrainConfig
from redraft.train.losses import (
    EvalAccumulator,
    drafter_loss,
    learn_positions,
    make_windows,
    real_token_mask,
    target_next_positions,
)
from redraft.train.precision import autocast, head_autocast


def target_hidden(target, ids: torch.Tensor, precision: str, layers=()) -> torch.Tensor:
    """The target's features, no graph: its last hidden states (the LM head's input) ``[B, T, H]``,
    or with ``layers`` (a ``multi`` head's ``config.hidden_layers``, the last one L) the hidden
    states of those layers concatenated, ``[B, T, len(layers) * H]`` (the last H columns are the
    last hidden state: :func:`last_hidden`).

    Right padding needs no attention mask: causal attention never looks at later pad tokens.
    """
    with torch.inference_mode(), autocast(ids.device, precision):
        if not layers:
            return target.model.base_model(input_ids=ids, use_cache=False).last_hidden_state
        out = target.model.base_model(input_ids=ids, use_cache=False, output_hidden_states=True)
        return torch.cat([out.hidden_states[i] for i in layers], dim=-1)


def last_hidden(target, features: torch.Tensor) -> torch.Tensor:
    """The last hidden state ``[..., H]`` of features ``[..., F]`` (:func:`target_hidden`)."""
    H = target.hidden_size
    return features if features.shape[-1] == H else features[..., -H:]


def target_greedy(target, hidden: torch.Tensor, precision: str, chunk: int = 512) -> torch.Tensor:
    """``argmax(lm_head(hidden))`` [B, T]: the target's greedy next token at every position."""
    head = target.output_head
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = []
    with torch.inference_mode(), autocast(hidden.device, precision):
        for i in range(0, flat.shape[0], chunk):  # chunks bound the [chunk, V] logits in memory
            out.append(head(flat[i : i + chunk]).argmax(-1))
    return torch.cat(out).view(hidden.shape[:-1])


def target_topk(
    target, hidden: torch.Tensor, precision: str, k: int, chunk: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-``k`` next-token ``(ids int32, logits float32)``, each ``[..., k]``,
    for hidden states ``[..., H]`` (the cached teacher of the KD loss)."""
    head = target.output_head
    flat = hidden.reshape(-1, hidden.shape[-1])
    ids, vals = [], []
    with torch.inference_mode(), autocast(hidden.device, precision):
        for i in range(0, flat.shape[0], chunk):  # chunks bound the [chunk, V] logits in memory
            top = head(flat[i : i + chunk]).float().topk(k, dim=-1)
            vals.append(top.values)
            ids.append(top.indices.to(torch.int32))
    shape = (*hidden.shape[:-1], k)
    return torch.cat(ids).view(shape), torch.cat(vals).view(shape)


def topk_teacher_logprobs(
    model: ReDrafter, topk_ids: torch.Tensor, topk_logits: torch.Tensor
) -> torch.Tensor:
    """Dense teacher log-probabilities ``[P, n, Vd]`` from the target's top-k logits ``[P, n, k]``:
    the softmax over the top-k ids that lie in the draft vocabulary (:func:`dense_teacher`)."""
    ids, probs = sparse_teacher(model.to_draft_ids(topk_ids.long()), topk_logits)
    return dense_teacher(ids, probs, model.config.out_vocab_size)


@torch.no_grad()
def warm_start_from_target(model: ReDrafter, target) -> None:
    """Output layer = the target's LM head on the x half (zeros on the state half), ResNet blocks =
    identity (zero weights: ``h + silu(0) = h``), so the untrained head starts from the target's
    own vocabulary geometry instead of a random projection (as Medusa initialises its heads)."""
    S = model.config.state_size
    W = target.output_head.weight.detach().float()  # [V, H]
    if model.config.draft_vocab_size is not None:
        W = W[model.draft_to_target.to(W.device)]
    model.lm_head.weight.zero_()
    model.lm_head.weight[:, S:] = W.to(model.lm_head.weight)
    for block in model.blocks:
        block.linear.weight.zero_()
        block.linear.bias.zero_()


def loss_weights(cfg: TrainConfig) -> tuple[float, float]:
    """``(ce_weight, kd_weight)`` of ``cfg.loss``."""
    ce_w = 0.0 if cfg.loss == "kd" else 1.0
    kd_w = 0.0 if cfg.loss == "ce" else (1.0 if cfg.loss == "kd" else cfg.kd_weight)
    return ce_w, kd_w


def resolve_loss_impl(cfg: TrainConfig, device: torch.device) -> str:
    """``cfg.loss_impl`` made concrete: ``fused``, ``liger`` or ``dense`` (see TrainConfig).

    ZeRO-3 partitions the output layer's weight and gathers it only inside the module's own
    forward, so the fused loss (which reads the weight directly) runs only at ZeRO 0-2.
    """
    from redraft.train import liger

    impl = cfg.loss_impl
    if impl == "auto":
        if cfg.zero_stage == 3:
            return "dense"
        return "liger" if liger.applies(cfg, device) and liger.available() else "fused"
    if impl in ("fused", "liger") and cfg.zero_stage == 3:
        raise ConfigError(
            f"--loss-impl {impl} reads the output layer's weight directly, which ZeRO-3 partitions; "
            f"use --loss-impl dense (or auto) with --zero-stage 3.",
            param="loss_impl",
        )
    if impl == "liger":
        liger.check(cfg, device)
    return impl


def batch_teacher(
    model: ReDrafter,
    target,
    batch: Batch,
    hidden: torch.Tensor,
    b,
    j,
    cfg: TrainConfig,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KD teacher at the targets ``[b, j]`` (``[P, n]``): ``(draft ids [P, n, k], logits [P, n, k])``
    of the target's top-k next tokens (from the feature cache, or the target's LM head on
    ``hidden`` at every position once, ``[B, T]`` rows, not ``[P, n]``)."""
    if batch.topk_ids is not None:
        ids, vals = batch.topk_ids, batch.topk_logits
    else:
        ids, vals = target_topk(target, last_hidden(target, hidden), precision, cfg.kd_top_k)
    return model.to_draft_ids(ids[b, j].long()), vals[b, j].float()


def window_positions(batch: Batch, cfg: TrainConfig, kd_w: float):
    """The positions :func:`make_windows` keeps, from the batch's CPU copy and uploaded without
    waiting (``Batch.host``), or None when the batch has no CPU copy (it is on the CPU)."""
    host = batch.host
    if host is None:
        return None
    b, t = learn_positions(host.mask, cfg.num_steps, kd_positions_mask(host, cfg, kd_w))
    dev = batch.ids.device
    return b.to(dev, non_blocking=True), t.to(dev, non_blocking=True)


def sample_windows(
    positions: tuple[torch.Tensor, torch.Tensor], fraction: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``round(fraction * P)`` of the positions ``(b [P], t [P])`` (at least one), drawn at
    random (torch's generator: ``seed`` seeds it) and kept in order; all of them at 1."""
    b, t = positions
    P = int(b.numel())
    k = max(1, round(fraction * P))
    if k >= P:  # every window (fraction 1)
        return positions
    keep = torch.randperm(P)[:k].sort().values.to(b.device, non_blocking=True)
    return b[keep], t[keep]


def kd_positions_mask(batch: Batch, cfg: TrainConfig, kd_w: float) -> torch.Tensor | None:
    """``[B, T]`` the tokens the KD term learns besides the assistant ones: every real token with
    ``kd_positions: all`` (the teacher there is the target's own next-token distribution for
    that context, prompts included) and on ``batch.kd_rows`` (KD-only records), else None (the
    KD term follows the loss mask)."""
    if not kd_w or (cfg.kd_positions != "all" and batch.kd_rows is None):
        return None
    if batch.lengths is None:
        raise ConfigError(
            "kd_positions: all needs each row's real length (Batch.lengths); this record source "
            "gives none. Use kd_positions: assistant, or a source from redraft.train.batches / "
            "redraft.train.features.",
            param="kd_positions",
        )
    real = real_token_mask(batch.ids, batch.lengths)  # [B, T]
    if cfg.kd_positions == "all":
        return real
    return real & batch.kd_rows[:, None]


def batch_loss(
    model: ReDrafter,
    forward,
    target,
    batch: Batch,
    cfg: TrainConfig,
    precision: str,
    hidden_dtype: torch.dtype | None = None,
    impl: str = "fused",
):
    """Loss of one micro batch. ``forward`` is the DeepSpeed engine (or the module in eval).

    The hidden states (and the KD teacher) come from ``batch`` when it carries cached features,
    else from a target forward. ``hidden_dtype``: what cached hidden states are cast to (the
    dtype the online target would give). ``impl``: :func:`resolve_loss_impl`.

    Returns ``(loss, stats, logits, windows, targets_draft)``; ``logits`` is ``[P, n, Vd]`` for
    ``impl="dense"`` and None otherwise (``stats["top1"]`` ``[P, n]`` then says where the head's
    top-1 was the data token, when the implementation gives it).
    """
    ids, mask = batch.ids, batch.mask
    if batch.hidden is not None:
        hidden = batch.hidden if hidden_dtype is None else batch.hidden.to(hidden_dtype)
    else:
        hidden = target_hidden(target, ids, precision, model.config.hidden_layers)  # [B, T, F]
    ce_w, kd_w = loss_weights(cfg)
    kd_mask = kd_positions_mask(batch, cfg, kd_w)
    positions = window_positions(batch, cfg, kd_w)
    if cfg.window_fraction < 1:
        if positions is None:  # the batch is on the CPU: nothing to wait for
            positions = learn_positions(mask, cfg.num_steps, kd_mask)
        positions = sample_windows(positions, cfg.window_fraction)
    win = make_windows(ids, mask, cfg.num_steps, kd_mask=kd_mask, positions=positions)
    # [P, F], a normal tensor (indexing leaves inference mode); the head projects F to H
    ctx = hidden[win.batch_idx, win.pos_idx]
    targets_d = model.to_draft_ids(win.targets)
    t_ids = t_probs = None
    if kd_w:
        b, j = target_next_positions(win, ids.shape[1])
        t_ids, t_probs = sparse_teacher(
            *batch_teacher(model, target, batch, hidden, b, j, cfg, precision)
        )
    if impl == "dense":
        with head_autocast(ids.device, precision):
            logits = forward(ctx, win.tokens)  # [P, n, Vd]: every position, every step, one pass
        teacher = None if t_ids is None else dense_teacher(t_ids, t_probs, logits.shape[-1])
        loss, stats = drafter_loss(
            logits,
            targets_d,
            win.valid,
            teacher,
            ce_weight=ce_w,
            kd_weight=kd_w,
            kd_valid=win.kd_valid,
            step_decay=cfg.step_decay,
        )
        return loss, stats, logits, win, targets_d
    with head_autocast(ids.device, precision):
        feats = forward(ctx, win.tokens, return_features=True)  # [P, n, S+H]
        if impl == "liger":
            from redraft.train.liger import liger_drafter_loss

            loss, stats = liger_drafter_loss(
                feats, model.lm_head.weight, targets_d, win.valid, cfg.step_decay
            )
        else:
            loss, stats = fused_drafter_loss(
                feats,
                model.lm_head.weight,
                targets_d,
                win.valid,
                t_ids,
                t_probs,
                ce_weight=ce_w,
                kd_weight=kd_w,
                kd_valid=win.kd_valid,
                step_decay=cfg.step_decay,
            )
    return loss, stats, None, win, targets_d


def dense_teacher(t_ids: torch.Tensor, t_probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """The sparse teacher (:func:`~redraft.models.losses.sparse_teacher`) as dense log-probabilities
    ``[P, n, Vd]``: the most negative float where it has no mass (its probability is exactly 0, so
    ``p * (log p - log q)`` is 0 there; with -inf it would be NaN)."""
    low = torch.finfo(torch.float32).min
    dense = torch.zeros(*t_ids.shape[:-1], vocab, device=t_ids.device).scatter_add_(
        -1, t_ids, t_probs
    )
    return torch.where(dense > 0, dense.clamp(min=1e-38).log(), low)


EVAL_LOGITS = 1 << 26  # logits values held at once by evaluate()


def heldout_target(target, ids: torch.Tensor, layers=()) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's features ``[B, T, F]`` and greedy tokens ``[B, T]`` for held-out metrics,
    computed as the decoder computes them: in the target's own dtype, no autocast (see
    :func:`evaluate`)."""
    hidden = target_hidden(target, ids, "fp32", layers)  # "fp32" = no autocast
    return hidden, target_greedy(target, last_hidden(target, hidden), "fp32")


@torch.no_grad()
def evaluate(model: ReDrafter, forward, target, ds, cfg: TrainConfig, env, precision: str) -> dict:
    """Held-out metrics (:class:`~redraft.train.losses.EvalAccumulator`), summed over all ranks.

    Every rank runs the same number of batches (ZeRO-3 forwards are collective); a rank
    with nothing left repeats a batch and does not count it.

    The target runs as the decoder runs it: in its weights' dtype, without autocast (float32 on
    a CPU, where training autocasts it to bf16; on a GPU its weights are bf16 or fp16 already,
    so nothing changes there). Its greedy tokens are what a greedy decode must reproduce, and
    under bf16 autocast near-ties flip: on the demo's held-out set the bf16 greedy differed from
    the float32 replies often enough to cost ~0.02 of ``eval_tau_est``
    (docs/design/0006-demo-recipe.md). The head keeps the training precision (drafts are bf16
    on CPUs that multiply bf16 natively).
    """
    was_training = model.training
    model.eval()
    lengths = sequence_lengths(ds)
    order = np.argsort(-lengths, kind="stable")  # similar lengths together: little padding
    mine = order[env.rank :: env.world_size]
    bs = cfg.eval_batch_size
    n_batches = math.ceil(math.ceil(len(order) / env.world_size) / bs)
    acc = EvalAccumulator(cfg.num_steps, device=env.device)
    for k in range(n_batches):
        idx = mine[k * bs : (k + 1) * bs]
        count = len(idx) > 0
        if not count:
            idx = order[:1]
        ids, mask = collate(ds, idx, env.device)
        hidden, greedy = heldout_target(target, ids, model.config.hidden_layers)
        win = make_windows(ids, mask, cfg.num_steps)
        ctx = hidden[win.batch_idx, win.pos_idx]
        b, j = target_next_positions(win, ids.shape[1])
        greedy_t = greedy[b, j]  # [P, n] the target's own token at each target position
        targets_d, greedy_d = model.to_draft_ids(win.targets), model.to_draft_ids(greedy_t)
        # positions in chunks: [rows, n, Vd] logits at a time (~64M values), never [P, n, Vd]
        rows = max(1, EVAL_LOGITS // (cfg.num_steps * model.config.out_vocab_size))
        for s in range(0, len(win), rows):
            with head_autocast(ids.device, precision):
                logits = forward(ctx[s : s + rows], win.tokens[s : s + rows])
            if count:
                acc.add(
                    logits,
                    targets_d[s : s + rows],
                    greedy_d[s : s + rows],
                    (win.targets == greedy_t)[s : s + rows],
                    win.valid[s : s + rows],
                )
    env.all_reduce(t := acc.as_tensor())
    acc.load_tensor(t)
    model.train(was_training)
    return acc.result()
