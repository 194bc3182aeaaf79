"""TrainConfig: every setting of a ``redraft-train`` run, its help, its valid range and the
cross-field rules (the settings schema of :mod:`redraft.settings`); recipes and overrides are
resolved into one by :mod:`redraft.train.config`."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from redraft.errors import ConfigError
from redraft.settings import Range, Settings, setting

_f = setting  # one line per field: name, default, help and its range, hint or choices


@dataclass
class TrainConfig(Settings):
    """Every setting of a ``redraft-train`` run (each is a recipe key and a ``--flag``)."""

    KIND = "training setting"

    # ---- target and data
    target: str = _f(
        "default", "Target model: 'default', a .gguf file, a local HF/PEFT directory or a hub id."
    )
    data: str = _f(
        "default-chat",
        "Training data source spec (redraft.data grammar, e.g. 'default-chat', "
        "'sharegpt:FILE.jsonl', a mixture).",
    )
    eval_data: str | None = _f(None, "Held-out data spec; none = the held-out split of --data.")
    max_length: int = _f(
        2048,
        "Truncate each tokenized record to this many tokens.",
        range=Range(3),
        hint=" (a window needs a context token, an input token and a target)",
    )
    self_distill: bool = _f(
        False,
        "Train and evaluate on the target's own greedy replies to the prompts of --data "
        "(made once with redraft-distill-data's code, cached in --distill-dir, resumable) "
        "instead of the replies in the data.",
    )
    distill_dir: str | None = _f(
        None,
        "Where the self-distilled JSONL files go; none = <redraft cache>/distilled/"
        "<target>-<hash of the target and the distill settings>.",
    )
    distill_limit: int | None = _f(
        2000,
        "Conversations of --data's train split to self-distill (held-out: "
        "--eval-limit); none = all.",
        range=Range(1),
    )
    distill_max_new_tokens: int = _f(256, "Longest self-distilled reply in tokens.", range=Range(1))
    distill_max_turns: int | None = _f(
        None,
        "Self-distill at most this many user turns per conversation; none = all.",
        range=Range(1),
    )
    distill_max_prompt_tokens: int = _f(
        1024,
        "Self-distill no turn whose prompt is longer (the prompt's prefill "
        "dominates generation time on a CPU); at most --max-length is used.",
        range=Range(1),
    )
    distill_batch_size: int = _f(
        8, "Replies generated together (prompts in flight) when self-distilling.", range=Range(1)
    )
    pack: bool = _f(False, "Pack records into max_length sequences (redraft.data).")
    heldout_fraction: float = _f(
        0.02,
        "Fraction of records (by id hash) held out for evaluation.",
        range=Range(0, 1, hi_open=True),
    )
    train_limit: int | None = _f(None, "Use at most this many training records.", range=Range(1))
    eval_limit: int | None = _f(
        200, "Evaluate on at most this many held-out records.", range=Range(1)
    )
    data_cache_dir: str | None = _f(
        None, "Token dataset cache directory; none = under the redraft cache."
    )
    num_proc: int | None = _f(
        None,
        "Processes for tokenization (datasets.map num_proc); none = the CPUs, at most 8.",
        range=Range(1),
    )

    # ---- the head
    num_steps: int = _f(
        5, "Training horizon n: draft tokens predicted from each hidden state.", range=Range(1)
    )
    num_layers: int = _f(2, "ResNet blocks in the head.", range=Range(0))
    rnn: bool = _f(
        True, "Use the recurrence s_i = f(U s_{i-1} + W e_i + b); false = paper's ablation."
    )
    activation: str = _f("silu", "Activation f of the recurrence and the ResNet blocks.")
    draft_vocab_size: int | None = _f(
        None,
        "Reduced draft vocabulary: the N most frequent target tokens "
        "(assistant tokens of the training data); none = full vocabulary.",
        range=Range(1),
    )
    head_features: str = _f(
        "last",
        "What the head reads of the target: 'last' (its last hidden state, the paper's "
        "ReDrafter; exports to Apple's layout) or 'multi' (a low, a middle and the last "
        "layer's hidden states concatenated and projected to the hidden size, EAGLE-3 style).",
        choices=("last", "multi"),
    )
    feature_layers: list[int] | None = _f(
        None,
        "'multi' only: the target's layers to read, ascending, ending with its last layer L "
        "(1-based decoder layer outputs, e.g. 8,15,30); none = ~L/4, ~L/2 and L.",
    )
    init_from: str | None = _f(
        None, "Start from the weights of this drafter artifact (fine-tuning)."
    )
    features: str | None = _f(
        None,
        "Train from the target features cached in this directory by "
        "redraft-cache-features (no target forward per step); they must match --target, "
        "--data, --max-length and the other data settings.",
    )
    kd_features: str | None = _f(
        None,
        "Extra cached target features (redraft-cache-features over other text, e.g. plain "
        "ShareGPT records: a forward pass, far cheaper than generating self-distilled replies), "
        "mixed into the training records and trained with the KL term only, on every token: "
        "the target's own next-token distribution over that text. Needs --features (the main "
        "records) and --loss kd or ce+kd.",
    )
    step_decay: float = _f(
        1.0,
        "Draft step i's mean loss counts step_decay^i (renormalised to a mean of 1 over the "
        "steps): below 1 the early steps, which every accepted chain needs, count more; 1 = the "
        "plain mean over the steps (the paper).",
        range=Range(0, 1, lo_open=True),
    )
    kd_data: str | None = _f(
        None,
        "Like --kd-features for a run that trains online (the target reads them each step, "
        "nothing is cached): a data spec (e.g. default-chat) whose train-split records are "
        "mixed into the training records and trained with the KL term only, on every token. "
        "Needs --loss kd or ce+kd; with --features, cache them and pass --kd-features.",
    )
    kd_limit: int | None = _f(None, "Use at most this many --kd-data records.", range=Range(1))
    init_head: str = _f(
        "random",
        "'random' (paper) or 'target': the output layer starts as the target's LM head "
        "on x (zeros on s) and the ResNet blocks as identity (Medusa-style warm start).",
        choices=("random", "target"),
    )

    # ---- objective
    loss: str = _f(
        "ce",
        "'ce' (cross-entropy on the data), 'kd' (KL to the target's distribution) or 'ce+kd'.",
        choices=("ce", "kd", "ce+kd"),
    )
    kd_weight: float = _f(1.0, "Weight of the KL term in 'ce+kd'.", range=Range(0))
    kd_positions: str = _f(
        "assistant",
        "Where the KL term of 'kd'/'ce+kd' counts: 'assistant' (the assistant tokens, as the "
        "cross-entropy) or 'all' (every token of the record, prompts too: the teacher there is "
        "the target's own next-token distribution; the cross-entropy stays on assistant tokens). "
        "Held-out metrics are always on assistant tokens.",
        choices=("assistant", "all"),
    )
    window_fraction: float = _f(
        1.0,
        "The share of each micro batch's windows (positions with something to learn) a training "
        "step learns, drawn at random every step; the losses are means, so a sample is an "
        "unbiased estimate. Below 1 a step costs that much less (the head's cost is per window): "
        "worth it where records are plenty and steps are few, e.g. a CPU budget of minutes over "
        "thousands of records. Held-out metrics use every window.",
        range=Range(0, 1, lo_open=True),
    )
    kd_top_k: int = _f(
        8,
        "KD teacher: the target's top-k next tokens, renormalised over those in the draft "
        "vocabulary (cached features hold their own top-k).",
        range=Range(1),
    )
    loss_impl: str = _f(
        "auto",
        "'fused' (chunked linear loss: never holds the [positions, steps, vocab] logits), "
        "'liger' (liger-kernel's fused linear cross-entropy; CUDA, loss ce), 'dense' (the "
        "reference) or 'auto' (liger where it applies and is installed, else fused; dense "
        "under ZeRO-3).",
        choices=("auto", "fused", "liger", "dense"),
    )

    # ---- optimisation (paper / Apple recipe defaults)
    epochs: float = _f(
        2,
        "Passes over the training data (fractions allowed).",
        range=Range(0, lo_open=True),
        hint=" (or set --max-steps)",
    )
    max_steps: int | None = _f(
        None,
        "Stop after this many optimizer steps, >= 1 (overrides epochs for the "
        "schedule); none = train for --epochs.",
        range=Range(1),
        hint=" (leave it out to train for --epochs)",
        flags=("--steps",),
        metavar="N",
    )
    max_time_minutes: float | None = _f(
        None,
        "Stop (checkpoint, evaluate, save) after this much training time.",
        range=Range(0, lo_open=True),
        hint=" (leave it out for no time budget)",
    )
    micro_batch_size: int = _f(1, "Sequences per micro batch per process.", range=Range(1))
    grad_accum: int = _f(
        8, "Micro batches accumulated per optimizer step (per process).", range=Range(1)
    )
    gpu_micro_batch_size: int | None = _f(
        None,
        "On CUDA, sequences per micro batch per process in place of micro_batch_size; grad_accum "
        "is scaled so that the batch per process (micro_batch_size x grad_accum) stays the same "
        "and must divide by it. None = micro_batch_size on every device. Typing --micro-batch-size "
        "or --grad-accum clears it (what you type is what runs).",
        range=Range(1),
        hint=" (leave it out to use --micro-batch-size on every device)",
    )
    lr: float = _f(
        1e-3,
        "Peak learning rate (AdamW).",
        range=Range(0, lo_open=True),
        hint=" (the peak AdamW learning rate, e.g. 1e-3)",
    )
    weight_decay: float = _f(0.0, "AdamW weight decay.", range=Range(0))
    adam_betas: tuple[float, float] = _f((0.9, 0.999), "AdamW betas.", metavar=("B1", "B2"))
    warmup_ratio: float = _f(
        0.1, "Linear warm-up as a fraction of the schedule.", range=Range(0, 1, hi_open=True)
    )
    min_lr_ratio: float = _f(
        0.0, "Final learning rate of the cosine decay, as a fraction of lr.", range=Range(0, 1)
    )
    schedule_by_time: bool = _f(
        False,
        "With max_time_minutes: run warm-up and cosine over the time budget "
        "instead of the step count (bounded CPU demos; resume is then not bit-exact).",
    )
    grad_clip: float = _f(
        1.0, "Gradient-norm clipping (0 = off).", range=Range(0), hint=" (0 turns clipping off)"
    )
    group_by_length: bool = _f(True, "Batch records of similar length together (less padding).")

    # ---- precision and DeepSpeed
    precision: str = _f(
        "auto",
        "'bf16', 'fp16', 'fp32' (DeepSpeed weights/optimizer precision) or "
        "'amp-bf16' (fp32 weights, bf16 autocast compute). auto: bf16 on GPU with ZeRO>=1, "
        "else amp-bf16.",
        choices=("auto", "bf16", "fp16", "fp32", "amp-bf16"),
    )
    zero_stage: int = _f(0, "ZeRO stage 0-3 (picks train/ds_zero<stage>.json).", range=Range(0, 3))
    deepspeed_config: str | None = _f(
        None, "A DeepSpeed JSON config; 'auto' values are filled from this config."
    )
    device: str = _f("auto", "'auto' (CUDA when available), 'cpu', 'cuda' or 'cuda:N'.")
    threads: int | None = _f(
        None,
        "CPU threads per process; none = the cores split between local ranks. "
        "On a CPU busy with other work 1 thread can be several times faster.",
        range=Range(1),
    )

    # ---- evaluation, logging, checkpoints
    eval_every: int = _f(
        500,
        "Evaluate on the held-out set every N optimizer steps (0 = only at the end).",
        range=Range(0),
    )
    eval_batch_size: int = _f(4, "Sequences per evaluation batch.", range=Range(1))
    save_every: int = _f(
        500,
        "Checkpoint every N optimizer steps (0 = only at the end / on a signal).",
        range=Range(0),
    )
    keep_checkpoints: int = _f(
        2, "Keep the newest N checkpoints in training_state/.", range=Range(1)
    )
    log_every: int = _f(
        10, "TensorBoard / progress-bar logging interval (optimizer steps).", range=Range(1)
    )
    # str | None: "none" reads as None, as runs saved it (parse_report_to takes either)
    report_to: str | None = _f(
        "tensorboard",
        "Experiment trackers (accelerate.tracking), a comma list of "
        "tensorboard (events in <output_dir>/tensorboard), wandb, mlflow; or none.",
    )
    output_dir: str | None = _f(None, "Run directory; none = checkpoints/<run_name>.")
    run_name: str | None = _f(None, "Run name; none = redrafter-<target name>.")
    seed: int = _f(0, "Seed of the head's init and of the data order.", range=Range(0, 2**32 - 1))

    # ---- publishing
    push_to_hub: str | None = _f(None, "Push the finished artifact to this hub repo id.")
    hub_private: bool = _f(False, "Create the hub repo as private.")
    hub_revision: str | None = _f(None, "Branch / revision to push to.")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["adam_betas"] = list(self.adam_betas)
        return d

    def resolved_output_dir(self) -> Path:
        if self.output_dir:
            return Path(self.output_dir).expanduser()
        return Path("checkpoints") / self.resolved_run_name()  # relative to the working directory

    def resolved_run_name(self) -> str:
        if self.run_name:
            return self.run_name
        name = self.target.rstrip("/").split("/")[-1].split("@")[0].removesuffix(".gguf")
        return f"redrafter-{name or 'target'}"

    def skip_check(self, key: str) -> bool:
        # epochs does not count when max_steps is set; adam_betas has its own message in check()
        return (key == "epochs" and bool(self.max_steps)) or key == "adam_betas"

    def check(self) -> None:
        """What the schema's types, ranges and choices cannot say (run by ``validate()``, which
        checks every setting's type and range; a ConfigError names the flag, the value and what
        is valid, ``param`` = the setting)."""
        if not (
            self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", str(self.device))
        ):
            raise ConfigError(
                f"--device {self.device!r}: use auto, cpu, cuda or cuda:N.", param="device"
            )
        betas = self.adam_betas
        if (
            not isinstance(betas, (list, tuple))
            or len(betas) != 2
            or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)
        ):
            raise ConfigError(
                f"--adam-betas {betas!r}: needs two numbers in [0, 1), e.g. 0.9 0.999.",
                param="adam_betas",
            )
        if self.schedule_by_time and not self.max_time_minutes:
            raise ConfigError(
                "--schedule-by-time needs --max-time-minutes (the budget the schedule spans).",
                param="schedule_by_time",
            )
        from transformers.activations import ACT2FN

        if self.activation not in ACT2FN:
            raise ConfigError(
                f"--activation {self.activation!r}: use one of {', '.join(sorted(ACT2FN))}.",
                param="activation",
            )
        parse_report_to(self.report_to)
        if self.kd_features and (not self.features or self.loss == "ce"):
            raise ConfigError(
                f"--kd-features {self.kd_features} needs --features (the main records, cached) "
                f"and --loss kd or ce+kd (here: features {self.features!r}, loss {self.loss!r}).",
                param="kd_features",
            )
        if self.kd_data and (self.features or self.loss == "ce"):
            raise ConfigError(
                f"--kd-data {self.kd_data} trains online with the KL term: it needs --loss kd or "
                f"ce+kd and no --features (here: features {self.features!r}, loss {self.loss!r}); "
                f"with cached features, cache these records too (redraft-cache-features --data "
                f"{self.kd_data} --set self_distill=false) and pass them as --kd-features.",
                param="kd_data",
            )
        per_process = self.micro_batch_size * self.grad_accum
        if self.gpu_micro_batch_size and per_process % self.gpu_micro_batch_size:
            raise ConfigError(
                f"--gpu-micro-batch-size {self.gpu_micro_batch_size} does not divide the batch per "
                f"process, micro_batch_size x grad_accum = {self.micro_batch_size} x "
                f"{self.grad_accum} = {per_process}: use a divisor of {per_process}.",
                param="gpu_micro_batch_size",
            )
        if self.feature_layers is not None and self.head_features != "multi":
            raise ConfigError(
                f"--feature-layers {self.feature_layers} needs --head-features multi (a 'last' "
                f"head reads the last hidden state only).",
                param="feature_layers",
            )


# report_to name -> the package it needs
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def parse_report_to(report_to: str | None) -> list[str]:
    """``"tensorboard,wandb"`` -> ``["tensorboard", "wandb"]``; ``"none"``/empty -> ``[]``.

    Raises ConfigError for an unknown name or a tracker whose package is not installed (checked
    in :meth:`TrainConfig.validate`, before any work).
    """
    import importlib.util

    names = [s.strip() for s in str(report_to or "none").split(",") if s.strip()]
    if names == ["none"]:
        return []
    for name in names:
        if name not in TRACKER_PACKAGES:
            raise ConfigError(
                f"--report-to {report_to!r}: {name!r} is not a tracker; use a comma list of "
                f"{', '.join(TRACKER_PACKAGES)}, or none.",
                param="report_to",
            )
        if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
            raise ConfigError(
                f"--report-to {name} needs the {TRACKER_PACKAGES[name]} package: "
                + (
                    "pip install 'redraft[train]'"  # the train extra's tracker
                    if name == "tensorboard"
                    else f"pip install {TRACKER_PACKAGES[name]}"
                )
                + " (or drop it from --report-to).",
                param="report_to",
            )
    return list(dict.fromkeys(names))
