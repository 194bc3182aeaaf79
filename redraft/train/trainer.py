"""The ReDrafter training loop (DeepSpeed), top to bottom.

    train(cfg)
      setup_distributed      one process without a launcher, or `deepspeed` / `torchrun` ranks
      load target + data     the frozen target computes hidden states on the fly
      build the head         ReDrafter(config for the target), optional reduced vocabulary
      deepspeed.initialize   AdamW + warm-up/cosine schedule, ZeRO config from train/
      loop                   per micro batch: target forward (inference mode) -> windows ->
                             drafter forward (all positions x n steps at once) -> loss ->
                             engine.backward / engine.step; log, evaluate, checkpoint, stop
      finish                 checkpoint, held-out evaluation, artifact + metrics.json + card

Only the drafter's parameters are in the optimizer; the target never gets gradients.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from redraft.errors import ConfigError, DataError
from redraft.models.redrafter import ReDrafter, ReDrafterConfig
from redraft.train import checkpoint as ckpt
from redraft.train.config import TRAIN_DIR, TrainConfig, config_diff
from redraft.train.losses import EvalAccumulator, drafter_loss, make_windows, target_next_positions
from redraft.utils import atomic_write_text

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ distributed


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        if self.world_size > 1:
            torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
        return t


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed(cfg: TrainConfig) -> DistEnv:
    """Join the launcher's process group, or make a world of one (no launcher needed).

    gloo on CPU, nccl on CUDA. On CPU the cores are split between the local ranks.
    """
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ:  # plain `python -m redraft.train.cli` / `redraft-train`
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if not use_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo", auto_mpi_discovery=False,
                                   verbose=False)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world)))
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // max(1, local_world)))
    return DistEnv(rank, world, local_rank, device)


# ------------------------------------------------------------------------------ precision


def resolve_precision(cfg: TrainConfig, device: torch.device) -> str:
    """``auto``: DeepSpeed bf16 (bf16 weights, fp32 master weights in the ZeRO optimizer) on GPUs
    with ZeRO >= 1; otherwise ``amp-bf16`` (fp32 weights, bf16 autocast), because DeepSpeed's
    bf16 without ZeRO keeps no fp32 master weights and small updates would be rounded away."""
    if cfg.precision != "auto":
        if cfg.precision == "bf16" and cfg.zero_stage == 0 and not cfg.deepspeed_config:
            logger.warning("precision bf16 with ZeRO stage 0 trains pure bf16 weights (no fp32 master "
                           "copy); prefer amp-bf16 or zero_stage >= 1")
        return cfg.precision
    return "bf16" if device.type == "cuda" and cfg.zero_stage >= 1 else "amp-bf16"


def autocast(device: torch.device, precision: str):
    """bf16 autocast for 'amp-bf16' (and for the target forward whenever precision is not fp32).

    On CPUs with AMX, bf16 matmuls over many tokens are several times faster than fp32.
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


def target_dtype(precision: str, device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.float16 if precision == "fp16" else (torch.float32 if precision == "fp32" else torch.bfloat16)
    return torch.float32  # CPU: fp32 weights, bf16 compute under autocast


def deepspeed_config(cfg: TrainConfig, precision: str) -> dict:
    """The JSON config (train/ds_zero<stage>.json or --deepspeed-config) with 'auto' values filled."""
    path = Path(cfg.deepspeed_config) if cfg.deepspeed_config else TRAIN_DIR / f"ds_zero{cfg.zero_stage}.json"
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config {path} does not exist; pass --deepspeed-config FILE or a "
                          f"--zero-stage whose train/ds_zero<stage>.json exists.")
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {exc}") from exc
    fill = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
    }
    for key, val in fill.items():
        if ds.get(key, "auto") == "auto":
            ds[key] = val
        elif ds[key] != val:
            raise ConfigError(f"{path} sets {key}={ds[key]} but the training config says {val}; set it to "
                              f"\"auto\" in the JSON or change the training setting.")
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from the two above and the world size
    for key in ("bf16", "fp16"):
        ds.setdefault(key, {})
        if ds[key].get("enabled", "auto") == "auto":
            ds[key]["enabled"] = precision == key
    ds.setdefault("steps_per_print", 10**9)  # our own logging
    ds.setdefault("wall_clock_breakdown", False)
    return ds


# ------------------------------------------------------------------------------ schedule


class WarmupCosine:
    """Linear warm-up then cosine decay, as a function of training progress in [0, 1].

    Progress is ``step / total_steps``, or with a time budget ``max(step / total_steps,
    elapsed / budget)`` so a bounded run still finishes its decay. ``factor(p) = p / w`` while
    ``p < w`` (w = warmup_ratio), then ``min + (1 - min) * (1 + cos(pi * (p - w) / (1 - w))) / 2``.
    DeepSpeed calls :meth:`step` after each optimizer step and checkpoints :meth:`state_dict`.
    """

    def __init__(self, optimizer, total_steps: int, warmup_ratio: float, min_lr_ratio: float = 0.0,
                 time_budget_s: float | None = None):
        self.optimizer = optimizer
        self.total_steps = max(1, int(total_steps))
        self.warmup_ratio = warmup_ratio
        self.min_lr_ratio = min_lr_ratio
        self.time_budget_s = time_budget_s
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.step_count = 0
        self.elapsed_s = 0.0  # set by the trainer before each optimizer step
        self._apply()

    def progress(self) -> float:
        p = (self.step_count + 1) / self.total_steps  # the step about to be taken
        if self.time_budget_s:
            p = max(p, self.elapsed_s / self.time_budget_s)
        return min(p, 1.0)

    def factor(self) -> float:
        p, w = self.progress(), self.warmup_ratio
        if w > 0 and p < w:
            return p / w
        q = (p - w) / (1 - w) if w < 1 else 1.0
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, q)))

    def _apply(self) -> None:
        f = self.factor()
        for g, lr in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = lr * f

    def step(self, *args, **kwargs) -> None:
        self.step_count += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "elapsed_s": self.elapsed_s, "base_lrs": self.base_lrs}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = state["step_count"]
        self.elapsed_s = state["elapsed_s"]
        self.base_lrs = state["base_lrs"]
        self._apply()


# ------------------------------------------------------------------------------ data


def load_datasets(cfg: TrainConfig, tokenizer, env: DistEnv, train: bool = True):
    """(train, heldout) token datasets from redraft.data; rank 0 tokenizes first (the cache).
    With ``train=False`` only the held-out set is built (train is None)."""
    try:
        from redraft.data import build_token_dataset
    except ImportError as exc:
        raise DataError(f"redraft.data.build_token_dataset is not available ({exc}).") from exc

    common = dict(max_length=cfg.max_length, pack=cfg.pack, heldout_fraction=cfg.heldout_fraction,
                  num_proc=cfg.num_proc, cache_dir=cfg.data_cache_dir)

    def build():
        tr = build_token_dataset(cfg.data, tokenizer, split="train", limit=cfg.train_limit, **common) \
            if train else None
        if cfg.eval_data:
            held = build_token_dataset(cfg.eval_data, tokenizer, split="all", limit=cfg.eval_limit, **common)
        else:
            held = build_token_dataset(cfg.data, tokenizer, split="heldout", limit=cfg.eval_limit, **common)
        return tr, held

    if not env.is_main:
        env.barrier()
    out = build()
    if env.is_main:
        env.barrier()
    return out


def _check_dataset(ds, what: str):
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise DataError(f"The {what} dataset lacks the column(s) {sorted(missing)}; it needs input_ids and "
                        f"loss_mask (redraft.data.build_token_dataset).")
    if len(ds) == 0:
        raise DataError(f"The {what} dataset is empty; check the data spec and --train-limit/--eval-limit.")
    return ds


def sequence_lengths(ds) -> np.ndarray:
    import pyarrow.compute as pc

    return pc.list_value_length(ds.with_format("arrow")["input_ids"]).to_numpy().astype(np.int64)


def draft_vocab_from_data(ds, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids among the assistant (loss-masked) tokens. [size] long."""
    import pyarrow.compute as pc

    tbl = ds.with_format("arrow")
    ids = pc.list_flatten(tbl["input_ids"]).to_numpy()
    mask = pc.list_flatten(tbl["loss_mask"]).to_numpy().astype(bool)
    counts = np.bincount(ids[mask].astype(np.int64), minlength=vocab_size)[:vocab_size]
    # ties broken by id so every rank picks the same set; never-seen ids fill up the tail
    order = np.lexsort((np.arange(vocab_size), -counts))
    return torch.from_numpy(order[:size].copy())


def epoch_batches(lengths: np.ndarray, global_batch: int, seed: int, epoch: int,
                  group_by_length: bool) -> np.ndarray:
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
        raise ConfigError(f"The training set has {n} records, fewer than one global batch "
                          f"(micro_batch_size x grad_accum x processes = {global_batch}); lower them.")
    order = order[: nb * global_batch]
    if group_by_length and global_batch > 1:
        chunk = global_batch * 32
        parts = [c[np.argsort(-lengths[c], kind="stable")] for c in np.array_split(order, max(1, len(order) // chunk))]
        order = np.concatenate(parts)
        batches = order.reshape(nb, global_batch)
        return batches[rng.permutation(nb)]
    return order.reshape(nb, global_batch)


def collate(ds, idx, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``idx`` -> right-padded ``input_ids`` [B, T] and ``loss_mask`` [B, T] (0 on padding)."""
    rows = ds[[int(i) for i in idx]]
    T = max(len(r) for r in rows["input_ids"])
    ids = torch.zeros(len(idx), T, dtype=torch.long)
    mask = torch.zeros(len(idx), T, dtype=torch.long)
    for b, (x, m) in enumerate(zip(rows["input_ids"], rows["loss_mask"])):  # B rows, not tokens
        ids[b, : len(x)] = torch.as_tensor(x, dtype=torch.long)
        mask[b, : len(m)] = torch.as_tensor(m, dtype=torch.long)
    return ids.to(device), mask.to(device)


# ------------------------------------------------------------------------------ the math per batch


def target_hidden(target, ids: torch.Tensor, precision: str) -> torch.Tensor:
    """The target's last hidden states (the LM head's input), ``[B, T, H]``, no graph.

    Right padding needs no attention mask: causal attention never looks at later pad tokens.
    """
    with torch.inference_mode(), autocast(ids.device, precision):
        return target.model.base_model(input_ids=ids, use_cache=False).last_hidden_state


def target_greedy(target, hidden: torch.Tensor, precision: str, chunk: int = 512) -> torch.Tensor:
    """``argmax(lm_head(hidden))`` [B, T]: the target's greedy next token at every position."""
    head = target.output_head
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = []
    with torch.inference_mode(), autocast(hidden.device, precision):
        for i in range(0, flat.shape[0], chunk):  # chunks bound the [chunk, V] logits in memory
            out.append(head(flat[i: i + chunk]).argmax(-1))
    return torch.cat(out).view(hidden.shape[:-1])


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


def batch_loss(model: ReDrafter, forward, target, ids, mask, cfg: TrainConfig, precision: str):
    """Loss of one micro batch. ``forward`` is the DeepSpeed engine (or the module in eval).

    Returns ``(loss, stats, logits, windows, targets_draft)``.
    """
    hidden = target_hidden(target, ids, precision)  # [B, T, H]
    win = make_windows(ids, mask, cfg.num_steps)
    ctx = hidden[win.batch_idx, win.pos_idx]  # [P, H], a normal tensor (indexing leaves inference mode)
    with autocast(ids.device, precision) if precision == "amp-bf16" else contextlib.nullcontext():
        logits = forward(ctx, win.tokens)  # [P, n, Vd]: every position, every step, one pass
    targets_d = model.to_draft_ids(win.targets)
    tlp = None
    if cfg.loss in ("kd", "ce+kd"):
        b, j = target_next_positions(win, ids.shape[1])
        with torch.inference_mode(), autocast(ids.device, precision):
            tl = target.output_head(hidden[b, j])  # [P, n, V]
            if model.config.draft_vocab_size is not None:
                tl = tl[..., model.draft_to_target]
            tlp = tl.float().log_softmax(-1)
        tlp = tlp.clone()
    ce_w = 0.0 if cfg.loss == "kd" else 1.0
    kd_w = 0.0 if cfg.loss == "ce" else (1.0 if cfg.loss == "kd" else cfg.kd_weight)
    loss, stats = drafter_loss(logits, targets_d, win.valid, tlp, ce_weight=ce_w, kd_weight=kd_w)
    return loss, stats, logits, win, targets_d


@torch.no_grad()
def evaluate(model: ReDrafter, forward, target, ds, cfg: TrainConfig, env: DistEnv, precision: str) -> dict:
    """Held-out metrics (:class:`~redraft.train.losses.EvalAccumulator`), summed over all ranks.

    Every rank runs the same number of batches (ZeRO-3 forwards are collective); a rank
    with nothing left repeats a batch and does not count it.
    """
    was_training = model.training
    model.eval()
    lengths = sequence_lengths(ds)
    order = np.argsort(-lengths, kind="stable")  # similar lengths together: little padding
    mine = order[env.rank:: env.world_size]
    bs = cfg.eval_batch_size
    n_batches = math.ceil(math.ceil(len(order) / env.world_size) / bs)
    acc = EvalAccumulator(cfg.num_steps, device=env.device)
    for k in range(n_batches):
        idx = mine[k * bs: (k + 1) * bs]
        count = len(idx) > 0
        if not count:
            idx = order[:1]
        ids, mask = collate(ds, idx, env.device)
        hidden = target_hidden(target, ids, precision)
        greedy = target_greedy(target, hidden, precision)  # [B, T]
        win = make_windows(ids, mask, cfg.num_steps)
        ctx = hidden[win.batch_idx, win.pos_idx]
        with autocast(ids.device, precision) if precision == "amp-bf16" else contextlib.nullcontext():
            logits = forward(ctx, win.tokens)
        b, j = target_next_positions(win, ids.shape[1])
        greedy_t = greedy[b, j]  # [P, n] the target's own token at each target position
        if count:
            acc.add(logits, model.to_draft_ids(win.targets), model.to_draft_ids(greedy_t),
                    win.targets == greedy_t, win.valid)
    env.all_reduce(t := acc.as_tensor())
    acc.load_tensor(t)
    model.train(was_training)
    return acc.result()


# ------------------------------------------------------------------------------ logging


class Logger:
    """TensorBoard (rank 0) with a no-op fallback."""

    def __init__(self, out: Path, enabled: bool):
        self.tb = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tensorboard"))
            except Exception as exc:  # tensorboard missing: training still runs
                logger.warning("TensorBoard disabled: %s", exc)

    def scalars(self, values: dict, step: int) -> None:
        if self.tb is None:
            return
        for k, v in values.items():
            if isinstance(v, (list, tuple)):
                for i, x in enumerate(v):
                    self.tb.add_scalar(f"{k}/pos{i}", x, step)
            elif v is not None:
                self.tb.add_scalar(k, v, step)

    def close(self):
        if self.tb is not None:
            self.tb.close()


def memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        return float("nan")


def _say(env: DistEnv, msg: str) -> None:
    if env.is_main:
        print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ the loop


class _Stop:
    """SIGINT/SIGTERM -> finish the current optimizer step, checkpoint, exit."""

    def __init__(self):
        self.signum = 0
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread: no handlers
                pass
        return self

    def _handle(self, signum, frame):
        if self.signum:  # a second signal: stop now
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\nredraft-train: got signal {signum}; checkpointing after this step "
              f"(send it again to abort without a checkpoint)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, target=None,
          train_dataset=None, eval_dataset=None, on_step=None) -> dict:
    """Train a ReDrafter head; returns the metrics dict (also written to metrics.json).

    Args:
        cfg: the resolved :class:`~redraft.train.config.TrainConfig`.
        resume: continue the run in ``cfg.output_dir`` from its newest checkpoint.
        overwrite: replace a run already in ``cfg.output_dir``.
        target: an already loaded Target (default: ``load_target(cfg.target)``).
        train_dataset, eval_dataset: token datasets (columns input_ids, loss_mask); default
            ``redraft.data.build_token_dataset(cfg.data ...)``.
        on_step: optional ``callback(state: dict)`` after every optimizer step (tests, hooks).
    """
    cfg.validate()
    env = setup_distributed(cfg)
    precision = resolve_precision(cfg, env.device)
    out = cfg.resolved_output_dir()
    resuming = ckpt.prepare_output_dir(out, resume, overwrite, env.rank)
    env.barrier()
    if resuming:
        saved = ckpt.load_run_config(out)
        diff = config_diff(saved or {}, cfg)
        if diff:
            raise ConfigError(
                f"--resume: these settings differ from the run saved in {out / 'run_config.yaml'}: "
                + ", ".join(f"{k} (saved {saved[k]!r}, now {getattr(cfg, k)!r})" for k in diff)
                + ". Resume with the same settings, or start a new run (--overwrite / another --output-dir)."
            )
    if env.is_main:
        ckpt.save_run_config(out, cfg.to_dict())
        import yaml

        _say(env, "redraft-train: resolved config\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
        _say(env, f"redraft-train: {env.world_size} process(es), device {env.device}, precision {precision}, "
                  f"ZeRO {cfg.zero_stage}, output {out}")

    # ---- target and data
    if target is None:
        from redraft.models import load_target

        target = load_target(cfg.target, dtype=target_dtype(precision, env.device), device=env.device)
    if train_dataset is None or eval_dataset is None:
        tr, ev = load_datasets(cfg, target.tokenizer, env)
        train_dataset = tr if train_dataset is None else train_dataset
        eval_dataset = ev if eval_dataset is None else eval_dataset
    _check_dataset(train_dataset, "training")
    _check_dataset(eval_dataset, "held-out")
    lengths = sequence_lengths(train_dataset)

    # ---- the head
    torch.manual_seed(cfg.seed)
    dcfg = ReDrafterConfig.for_target(target, num_layers=cfg.num_layers, rnn=cfg.rnn, activation=cfg.activation,
                                      num_steps=cfg.num_steps, draft_vocab_size=cfg.draft_vocab_size)
    model = ReDrafter(dcfg)
    if cfg.init_from:
        from redraft.models.redrafter import load_drafter

        src = load_drafter(cfg.init_from, target, dtype=torch.float32)
        if src.config.draft_vocab_size != dcfg.draft_vocab_size:
            raise ConfigError(f"init_from {cfg.init_from} has draft_vocab_size {src.config.draft_vocab_size}, "
                              f"this run {dcfg.draft_vocab_size}; make them equal.")
        model.load_state_dict(src.state_dict())
    else:
        if cfg.draft_vocab_size:
            model.set_draft_vocab(draft_vocab_from_data(train_dataset, dcfg.vocab_size, cfg.draft_vocab_size))
        if cfg.init_head == "target":
            warm_start_from_target(model, target)
    model.attach_target(target).to(env.device).train()

    # ---- optimizer, schedule, DeepSpeed
    global_batch = cfg.micro_batch_size * cfg.grad_accum * env.world_size
    steps_per_epoch = len(lengths) // global_batch
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.adam_betas),
                            weight_decay=cfg.weight_decay)
    budget_s = cfg.max_time_minutes * 60 if (cfg.max_time_minutes and cfg.schedule_by_time) else None
    sched = WarmupCosine(opt, total_steps, cfg.warmup_ratio, cfg.min_lr_ratio, time_budget_s=budget_s)
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                           config=deepspeed_config(cfg, precision))
    model = engine.module

    state = {"global_step": 0, "epoch": 0, "batch_in_epoch": 0, "tokens": 0, "loss_tokens": 0, "elapsed_s": 0.0}
    if resuming:
        loaded = ckpt.load_checkpoint(engine, out, env.rank)
        if loaded is None:
            _say(env, f"redraft-train: --resume but no checkpoint in {out / ckpt.STATE_DIR}; starting fresh")
        else:
            state.update(loaded)
            _say(env, f"redraft-train: resumed from step {state['global_step']} (epoch {state['epoch']}, "
                      f"batch {state['batch_in_epoch']})")

    _say(env, f"redraft-train: {len(lengths)} training records ({int(lengths.sum())} tokens), "
              f"{len(eval_dataset)} held-out; {model.num_trainable_parameters() / 1e6:.2f}M trainable "
              f"parameters; {steps_per_epoch} steps/epoch, {total_steps} steps")

    log = Logger(out, cfg.tensorboard and env.is_main)
    metrics: dict = {}
    status = "completed"
    n = cfg.num_steps
    t_start = time.perf_counter() - state["elapsed_s"]
    run_tokens0, run_t0 = state["tokens"], time.perf_counter()
    from tqdm.auto import tqdm

    bar = tqdm(total=total_steps, initial=state["global_step"], disable=not env.is_main, unit="step",
               dynamic_ncols=True, desc="train")
    window = {"loss": 0.0, "steps": torch.zeros(n), "counts": torch.zeros(n), "top1": torch.zeros(n),
              "top5": torch.zeros(n), "tokens": 0, "t0": time.perf_counter(), "micro": 0}

    with _Stop() as stop:
        while state["global_step"] < total_steps and status == "completed":
            batches = epoch_batches(lengths, global_batch, cfg.seed, state["epoch"], cfg.group_by_length)
            while state["batch_in_epoch"] < len(batches):
                gb = batches[state["batch_in_epoch"]]
                log_step = (state["global_step"] + 1) % cfg.log_every == 0
                # micro batch j of the global batch goes to rank j % world: the same micro
                # batches as one process with world x grad_accum accumulation.
                for k in range(cfg.grad_accum):
                    j = env.rank + env.world_size * k
                    idx = gb[j * cfg.micro_batch_size:(j + 1) * cfg.micro_batch_size]
                    ids, mask = collate(train_dataset, idx, env.device)
                    ntok = int(lengths[idx].sum())  # real tokens (no padding)
                    loss, st, logits, win, tgt = batch_loss(model, engine, target, ids, mask, cfg, precision)
                    engine.backward(loss)
                    if engine.is_gradient_accumulation_boundary():
                        sched.elapsed_s = time.perf_counter() - t_start
                        if log_step and engine.zero_optimization_stage() == 0:
                            window["grad_norm"] = float(torch.linalg.vector_norm(torch.stack(
                                [p.grad.float().norm() for p in model.parameters() if p.grad is not None])))
                    engine.step()
                    window["loss"] += loss.item()
                    window["micro"] += 1
                    window["steps"] += (st["step_loss"] * st["step_count"]).cpu()
                    window["counts"] += st["step_count"].cpu()
                    window["tokens"] += ntok
                    if log_step and len(win):
                        with torch.no_grad():
                            top5 = logits.topk(min(5, logits.shape[-1]), -1).indices
                            ok = win.valid & (tgt >= 0)
                            window["top1"] += ((top5[..., 0] == tgt) & ok).sum(0).cpu().float()
                            window["top5"] += ((top5 == tgt[..., None]).any(-1) & ok).sum(0).cpu().float()
                    state["tokens"] += ntok
                    state["loss_tokens"] += int(win.valid[:, 0].sum()) if len(win) else 0
                state["global_step"] += 1
                state["batch_in_epoch"] += 1
                state["elapsed_s"] = time.perf_counter() - t_start
                bar.update(1)

                if log_step or state["global_step"] == total_steps:
                    dt = max(time.perf_counter() - window["t0"], 1e-9)
                    tok_s = torch.tensor([window["tokens"] / dt], dtype=torch.float64)
                    env.all_reduce(tok_s)
                    counts = window["counts"].clamp(min=1)
                    vals = {
                        "train/loss": window["loss"] / max(1, window["micro"]),
                        "train/step_loss": (window["steps"] / counts).tolist(),
                        "train/top1": (window["top1"] / counts).tolist() if log_step else None,
                        "train/top5": (window["top5"] / counts).tolist() if log_step else None,
                        "train/lr": sched.get_last_lr()[0],
                        "train/grad_norm": window.get("grad_norm") if engine.zero_optimization_stage() == 0
                        else float(engine.get_global_grad_norm() or 0.0),
                        "train/tokens_per_s": float(tok_s),
                        "train/memory_mb": memory_mb(env.device),
                    }
                    log.scalars({k: v for k, v in vals.items() if v is not None}, state["global_step"])
                    bar.set_postfix(loss=f"{vals['train/loss']:.3f}", tok_s=f"{float(tok_s):.0f}",
                                    lr=f"{vals['train/lr']:.2e}")
                    window.update(loss=0.0, steps=torch.zeros(n), counts=torch.zeros(n), top1=torch.zeros(n),
                                  top5=torch.zeros(n), tokens=0, t0=time.perf_counter(), micro=0)
                    window.pop("grad_norm", None)

                if on_step is not None:
                    on_step(dict(state))

                flags = torch.tensor([float(stop.signum != 0),
                                      float(bool(cfg.max_time_minutes) and
                                            state["elapsed_s"] >= cfg.max_time_minutes * 60)])
                env.all_reduce(flags, torch.distributed.ReduceOp.MAX)
                if flags[0]:
                    status = "interrupted"
                    break
                if flags[1]:
                    status = "time_budget"
                    break
                if state["global_step"] >= total_steps:
                    break
                if cfg.eval_every and state["global_step"] % cfg.eval_every == 0:
                    metrics = evaluate(model, engine, target, eval_dataset, cfg, env, precision)
                    log.scalars({f"eval/{k[5:]}": v for k, v in metrics.items()}, state["global_step"])
                    _say(env, _eval_line(state["global_step"], metrics))
                if cfg.save_every and state["global_step"] % cfg.save_every == 0:
                    ckpt.save_checkpoint(engine, out, state, env.rank, cfg.keep_checkpoints, env.barrier)
            else:  # epoch finished
                state["epoch"] += 1
                state["batch_in_epoch"] = 0
    bar.close()
    train_time = time.perf_counter() - run_t0
    run_tokens = state["tokens"] - run_tokens0

    # ---- finish: checkpoint, evaluate, artifact
    ckpt.save_checkpoint(engine, out, state, env.rank, cfg.keep_checkpoints, env.barrier)
    tok = torch.tensor([run_tokens / max(train_time, 1e-9), state["tokens"]], dtype=torch.float64)
    env.all_reduce(tok)  # summed over ranks: the run's tokens/s and tokens
    if status != "interrupted":
        metrics = evaluate(model, engine, target, eval_dataset, cfg, env, precision)
        log.scalars({f"eval/{k[5:]}": v for k, v in metrics.items()}, state["global_step"])
    metrics = {
        "status": status,
        "global_step": state["global_step"],
        "total_steps": total_steps,
        "epochs_done": state["epoch"] + state["batch_in_epoch"] / max(1, steps_per_epoch),
        "train_tokens": int(tok[1]),
        "train_time_s": state["elapsed_s"],
        "train_tokens_per_s": float(tok[0]),
        "world_size": env.world_size,
        "precision": precision,
        "device": str(env.device),
        **metrics,
    }
    write_artifact(engine, model, out, cfg, metrics, env)
    log.close()
    if env.is_main:
        if "eval_top1" in metrics:
            _say(env, _eval_line(state["global_step"], metrics))
        _say(env, f"redraft-train: {status} at step {state['global_step']}; artifact in {out}")
        _say(env, f"redraft-train: use it with  load_drafter({str(out)!r}, load_target({cfg.target!r}))  "
                  f"(redraft.models.redrafter), or benchmark it: redraft-bench --methods greedy,redrafter --drafter {out}")
    if cfg.push_to_hub and env.is_main and status != "interrupted":
        from redraft.hub import push_artifact

        url = push_artifact(out, cfg.push_to_hub, private=cfg.hub_private, revision=cfg.hub_revision)
        _say(env, f"redraft-train: pushed to {url}")
    env.barrier()
    return metrics


def evaluate_artifact(cfg: TrainConfig, path=None, target=None, eval_dataset=None) -> dict:
    """Held-out metrics of a finished drafter artifact (``path`` or ``cfg.init_from``) on
    ``cfg.eval_data`` / the held-out split of ``cfg.data``; no training, nothing written."""
    from redraft.models.redrafter import load_drafter

    path = path or cfg.init_from
    if not path:
        raise ConfigError("Evaluation needs a drafter artifact: pass --init-from DIR (or REPO_ID).")
    env = setup_distributed(cfg)
    precision = resolve_precision(cfg, env.device)
    if target is None:
        from redraft.models import load_target

        target = load_target(cfg.target, dtype=target_dtype(precision, env.device), device=env.device)
    if eval_dataset is None:
        _, eval_dataset = load_datasets(cfg, target.tokenizer, env, train=False)
    _check_dataset(eval_dataset, "held-out")
    drafter = load_drafter(path, target, dtype=torch.float32)
    cfg = TrainConfig(**{**cfg.to_dict(), "num_steps": drafter.config.num_steps,
                         "adam_betas": tuple(cfg.adam_betas)})
    m = evaluate(drafter, drafter, target, eval_dataset, cfg, env, precision)
    _say(env, _eval_line(0, m).replace("[eval @ step 0]", f"[eval {path}]"))
    return m


def _eval_line(step: int, m: dict) -> str:
    top1 = " ".join(f"{a:.3f}" for a in m["eval_top1"])
    top1t = " ".join(f"{a:.3f}" for a in m["eval_top1_target"])
    return (f"[eval @ step {step}] loss {m['eval_loss']:.3f} | top-1 by position (data) {top1} | "
            f"(target greedy) {top1t} | tau_est {m['eval_tau_est']:.3f} (vs data {m['eval_tau_est_data']:.3f})")


def full_state_dict(engine, model) -> dict:
    """The head's weights on CPU (gathered from all ranks under ZeRO-3)."""
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def write_artifact(engine, model: ReDrafter, out: Path, cfg: TrainConfig, metrics: dict, env: DistEnv) -> None:
    """config.json + model.safetensors + metrics.json + README.md in ``out`` (rank 0, atomic per file)."""
    state = full_state_dict(engine, model)
    if not env.is_main:
        return
    clean = ReDrafter(model.config)
    clean.load_state_dict(state)
    tmp = out / f".artifact.tmp{os.getpid()}"
    clean.save_pretrained(str(tmp), safe_serialization=True)
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=2))
    try:
        from redraft.hub import write_model_card

        write_model_card(out)
    except Exception as exc:  # hub module missing or card failed: a minimal card of our own
        logger.info("hub model card unavailable (%s); writing a minimal one", exc)
        atomic_write_text(out / "README.md", ckpt.model_card(model.config, metrics, cfg.to_dict()))
