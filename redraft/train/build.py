"""The head and its engine: ReDrafter sized for the target (seeded, or ``init_from``; the draft
vocabulary, the warm start) and AdamW with the warm-up/cosine schedule inside DeepSpeed."""

from __future__ import annotations

import torch

from redraft.errors import ConfigError
from redraft.models.redrafter import ReDrafter, ReDrafterConfig
from redraft.train.batches import draft_vocab_from_tokens
from redraft.train.config import TrainConfig
from redraft.train.precision import deepspeed_config
from redraft.train.schedule import WarmupCosine
from redraft.train.step import warm_start_from_target


def build_head(cfg: TrainConfig, target, records, record: dict) -> ReDrafter:
    """The head for ``target``: seeded init (or ``init_from``), the draft vocabulary, the warm start."""
    torch.manual_seed(cfg.seed)
    dcfg = ReDrafterConfig.for_target(
        target,
        num_layers=cfg.num_layers,
        rnn=cfg.rnn,
        activation=cfg.activation,
        num_steps=cfg.num_steps,
        draft_vocab_size=cfg.draft_vocab_size,
        features=cfg.head_features,
        feature_layers=cfg.feature_layers,
        target_weights_fingerprint=record["weights_fingerprint"],
    )
    check_records_layers(records, dcfg.hidden_layers, cfg)
    model = ReDrafter(dcfg)
    if cfg.init_from:
        from redraft.models.drafter_io import load_drafter

        src = load_drafter(cfg.init_from, target, dtype=torch.float32)
        for key in ("draft_vocab_size", "features", "feature_layers"):
            if getattr(src.config, key) != getattr(dcfg, key):
                raise ConfigError(
                    f"init_from {cfg.init_from} has {key} {getattr(src.config, key)}, this run "
                    f"{getattr(dcfg, key)}; make them equal.",
                    param="init_from",
                )
        model.load_state_dict(src.state_dict())
    else:
        if cfg.draft_vocab_size:
            model.set_draft_vocab(
                draft_vocab_from_tokens(
                    *records.token_arrays(), dcfg.vocab_size, cfg.draft_vocab_size
                )
            )
        if cfg.init_head == "target":
            warm_start_from_target(model, target)
    return model.attach_target(target)


def check_records_layers(records, layers: tuple[int, ...], cfg: TrainConfig) -> None:
    """Cached features must hold the layers the head reads (``()``: the last hidden state)."""
    cached = getattr(records, "hidden_layers", None)
    if cached is not None and tuple(cached) != tuple(layers):
        raise ConfigError(
            f"--features {cfg.features} hold the target's hidden states of layers "
            f"{list(cached) or 'last'}, but this head (--head-features {cfg.head_features}) reads "
            f"{list(layers) or 'last'}; cache features with the same --head-features / "
            f"--feature-layers (redraft-cache-features), or train without --features.",
            param="features",
        )


def build_engine(cfg: TrainConfig, model: ReDrafter, total_steps: int, precision: str):
    """``(engine, schedule)``: AdamW over the head alone and the warm-up/cosine schedule, in DeepSpeed."""
    import deepspeed

    params = list(model.parameters())
    # On a CPU torch's AdamW defaults to one tensor at a time (foreach is a CUDA default): the
    # fused kernel takes 11 -> 2.7 ms a step off the demo head's 8M parameters (measured with
    # the demo recipe); the state is the same, so checkpoints load either way. CUDA keeps
    # torch's default (foreach), which DeepSpeed's ZeRO optimizers have always been run with here.
    fused = all(p.device.type == "cpu" for p in params)
    opt = torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.adam_betas),
        weight_decay=cfg.weight_decay,
        fused=fused or None,
    )
    budget_s = (
        cfg.max_time_minutes * 60 if (cfg.max_time_minutes and cfg.schedule_by_time) else None
    )
    sched = WarmupCosine(
        opt, total_steps, cfg.warmup_ratio, cfg.min_lr_ratio, time_budget_s=budget_s
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=deepspeed_config(cfg, precision)
    )
    if engine.dp_world_size == 1 and engine.zero_optimization_stage() == 0:
        # one process, no ZeRO: nothing to reduce, but DeepSpeed still flattens every gradient,
        # "all-reduces" it with itself and copies it back after each backward (milliseconds a step for
        # the demo head on a CPU; its "allreduce_gradients" in a profile)
        engine.enable_backward_allreduce = False
    return engine, sched
