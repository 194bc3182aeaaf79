"""Recipes, overrides, DeepSpeed configs, schedule, data order."""

import numpy as np
import pytest
import torch

from redraft.errors import ConfigError
from redraft.train.batches import draft_vocab_from_data, epoch_batches
from redraft.train.cli import build_parser, config_from_args
from redraft.train.config import RECIPES_DIR, TrainConfig, load_recipe, make_config
from redraft.train.precision import deepspeed_config
from redraft.train.schedule import WarmupCosine


def test_every_shipped_recipe_loads():
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    assert {"default", "tiny", "vicuna-7b-8xh100", "llama3-8b-8xh100"} <= set(names)
    for name in names:
        make_config(name)


def test_unknown_recipe_key_is_named(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("lr: 1e-3\nlearning_rate: 3\n")
    with pytest.raises(ConfigError, match="learning_rate") as exc:
        load_recipe(str(bad))
    assert str(bad) in str(exc.value)


def test_unknown_set_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match="num_layer.*num_layers"):
        config_from_args(build_parser().parse_args(["--recipe", "tiny", "--set", "num_layer=3"]))


def test_flags_override_recipe_and_are_typed():
    args = build_parser().parse_args(
        [
            "--recipe",
            "tiny",
            "--lr",
            "5e-4",
            "--no-rnn",
            "--set",
            "max_steps=7",
            "--adam-betas",
            "0.8",
            "0.95",
        ]
    )
    cfg = config_from_args(args)
    tiny = load_recipe("tiny")
    assert (
        cfg.lr == 5e-4 and cfg.rnn is False and cfg.max_steps == 7 and cfg.adam_betas == (0.8, 0.95)
    )
    assert (
        cfg.num_steps == tiny["num_steps"] != TrainConfig().num_steps
    )  # untouched recipe keys stay


def test_bad_values_are_errors():
    with pytest.raises(ConfigError, match="loss"):
        make_config(None, {"loss": "mse"})
    with pytest.raises(ConfigError, match="micro_batch_size"):
        make_config(None, {"micro_batch_size": "two"})


def test_deepspeed_config_fills_auto_values_and_rejects_conflicts(tmp_path):
    cfg = make_config("tiny", {"zero_stage": 2, "grad_accum": 3})
    ds = deepspeed_config(cfg, "bf16")
    assert ds["zero_optimization"]["stage"] == 2
    assert (
        ds["gradient_accumulation_steps"] == 3
        and ds["train_micro_batch_size_per_gpu"] == cfg.micro_batch_size
    )
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    f = tmp_path / "ds.json"
    f.write_text('{"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 0}}')
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        deepspeed_config(make_config("tiny", {"deepspeed_config": str(f), "grad_accum": 3}), "fp32")


def test_warmup_then_cosine_to_min():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = WarmupCosine(opt, total_steps=10, warmup_ratio=0.2, min_lr_ratio=0.1)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        s.step()
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)  # warm-up over 2 steps
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))  # then decays
    assert lrs[-1] == pytest.approx(0.1)  # the last step runs at min_lr
    s2 = WarmupCosine(opt, total_steps=10, warmup_ratio=0.2, min_lr_ratio=0.1)
    s2.load_state_dict(s.state_dict())
    assert s2.get_last_lr() == s.get_last_lr()


def test_epoch_order_is_deterministic_and_uses_each_record_once():
    lengths = np.random.default_rng(0).integers(5, 100, 103)
    a = epoch_batches(lengths, 8, seed=3, epoch=1, group_by_length=True)
    b = epoch_batches(lengths, 8, seed=3, epoch=1, group_by_length=True)
    assert a.shape == (12, 8) and np.array_equal(a, b)
    assert len(np.unique(a)) == a.size
    assert not np.array_equal(a, epoch_batches(lengths, 8, seed=3, epoch=2, group_by_length=True))
    # grouping by length: far less padding than a random order
    pad = lambda bt: (lengths[bt].max(1, keepdims=True) - lengths[bt]).sum()  # noqa: E731
    assert pad(a) < 0.5 * pad(epoch_batches(lengths, 8, seed=3, epoch=1, group_by_length=False))
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        epoch_batches(lengths[:5], 8, 0, 0, False)


def test_draft_vocab_is_the_most_frequent_assistant_tokens():
    import datasets

    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [[7, 7, 7, 7, 3, 3, 5], [3, 9, 9]],
            "loss_mask": [[0, 0, 0, 1, 1, 1, 1], [1, 1, 1]],  # 7 is frequent but mostly unmasked
        }
    )
    ids = draft_vocab_from_data(ds, vocab_size=12, size=3)
    assert ids.tolist() == [3, 9, 5]


def _outside(r):
    """A value just outside a Range (below its low end, or above its high end when it has one)."""
    return r.lo if r.lo_open else (r.lo - 1 if isinstance(r.lo, int) else r.lo - 0.5)


@pytest.mark.parametrize(
    "key", sorted(__import__("redraft.train.config", fromlist=["RANGES"]).RANGES)
)
def test_every_numeric_setting_is_range_checked_with_flag_value_and_range(key):
    from redraft.train.config import RANGES

    r = RANGES[key]
    for bad in (_outside(r), float("nan"), *([r.hi + 1] if r.hi is not None else [])):
        with pytest.raises(ConfigError) as exc:
            make_config(None, {key: bad, **({"max_steps": None} if key == "epochs" else {})})
        assert exc.value.param == key
        msg = str(exc.value)
        assert msg.startswith("--" + key.replace("_", "-")) and str(r) in msg, msg
    make_config(
        None, {key: r.lo if not r.lo_open else r.lo + 1}
    )  # the edge itself (or just inside) is fine


def test_max_steps_zero_is_an_error_and_epochs_need_not_be_set_with_max_steps():
    with pytest.raises(
        ConfigError, match=r"--max-steps 0 is out of range: must be >= 1 \(leave it out"
    ):
        make_config("tiny", {"max_steps": "0"})
    assert make_config("tiny", {"max_steps": "3", "epochs": "0"}).max_steps == 3


def test_schedule_is_transformers_cosine_with_min_lr_one_step_later():
    """Why WarmupCosine stays ours (schedule.py): the same curve shifted by one step, so HF's first
    step has lr 0 and its last is above the minimum; and HF's cannot follow a time budget."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    total, warmup, floor = 20, 0.2, 0.1
    ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hf_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ours = WarmupCosine(ours_opt, total, warmup, floor)
    hf = get_cosine_with_min_lr_schedule_with_warmup(
        hf_opt, int(warmup * total), total, min_lr_rate=floor
    )
    ours_lrs, hf_lrs = [], []
    for _ in range(total):
        ours_lrs.append(ours_opt.param_groups[0]["lr"])
        hf_lrs.append(hf_opt.param_groups[0]["lr"])
        ours.step()
        hf_opt.step()
        hf.step()
    assert ours_lrs[:-1] == pytest.approx(hf_lrs[1:])
    assert hf_lrs[0] == 0 and ours_lrs[0] > 0
    assert ours_lrs[-1] == pytest.approx(floor) and hf_lrs[-1] > floor + 1e-3
    timed = WarmupCosine(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
        total,
        warmup,
        floor,
        time_budget_s=60,
    )
    timed.elapsed_s = 60.0  # the budget is spent after one step: the schedule is at its end
    timed.step()
    assert timed.get_last_lr()[0] == pytest.approx(floor)


def test_meter_reads_loss_and_topk_once_and_matches_eval_accumulator():
    from redraft.train.distributed import DistEnv
    from redraft.train.logger import Meter
    from redraft.train.losses import EvalAccumulator

    torch.manual_seed(0)
    env = DistEnv(0, 1, 0, torch.device("cpu"))
    meter = Meter(3, env.device)
    acc = EvalAccumulator(3)
    losses = []
    for _ in range(2):
        logits, tgt, valid = (
            torch.randn(7, 3, 10),
            torch.randint(0, 10, (7, 3)),
            torch.rand(7, 3) > 0.3,
        )
        loss = torch.rand(())
        losses.append(float(loss))
        meter.add(loss, {"step_loss": torch.rand(3), "step_count": valid.sum(0).float()}, tokens=11)
        meter.add_accuracy(logits, tgt, valid)
        acc.add(logits, tgt, tgt, torch.ones_like(valid), valid)
    vals = meter.read(env)
    ref = acc.result()
    assert vals["train/loss"] == pytest.approx(sum(losses) / 2)
    assert vals["train/top1"] == pytest.approx(ref["eval_top1"]) and vals[
        "train/top5"
    ] == pytest.approx(ref["eval_top5"])
    assert vals["train/tokens_per_s"] > 0
    meter.reset()
    assert meter.read(env)["train/top1"] is None and meter.micro == 0


def test_trackers_write_tensorboard_scalars_per_position(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from redraft.train.config import parse_report_to
    from redraft.train.logger import Trackers

    t = Trackers(parse_report_to("tensorboard"), tmp_path, "run", {"lr": 1e-3})
    t.log({"train/loss": 1.5, "train/top1": [0.25, 0.5], "train/grad_norm": None}, step=3)
    t.close()
    ev = EventAccumulator(str(tmp_path / "tensorboard"))
    ev.Reload()
    assert {"train/loss", "train/top1/pos0", "train/top1/pos1"} <= set(ev.Tags()["scalars"])
    assert [(s.step, s.value) for s in ev.Scalars("train/top1/pos1")] == [(3, 0.5)]
    assert parse_report_to("none") == [] and parse_report_to("tensorboard,tensorboard") == [
        "tensorboard"
    ]
    with pytest.raises(ConfigError, match="not a tracker"):
        parse_report_to("tensorboard,comet")
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ConfigError, match="pip install wandb"):
            parse_report_to("wandb")


def test_the_default_recipe_runs_one_micro_batch_of_16_on_a_gpu_and_16_of_1_elsewhere():
    from redraft.train.config import for_device

    cfg = make_config("default")
    assert (cfg.micro_batch_size, cfg.grad_accum, cfg.gpu_micro_batch_size) == (1, 16, 16)
    gpu = for_device(cfg, torch.device("cuda", 0))
    assert (gpu.micro_batch_size, gpu.grad_accum) == (16, 1)
    assert for_device(cfg, "cpu") is cfg
    assert deepspeed_config(gpu, "amp-bf16")["train_micro_batch_size_per_gpu"] == 16
    assert deepspeed_config(gpu, "amp-bf16")["gradient_accumulation_steps"] == 1
    # a shape typed on the command line is the one that runs, also on a GPU
    args = build_parser().parse_args(["--micro-batch-size", "4", "--grad-accum", "4"])
    typed = config_from_args(args)
    assert typed.gpu_micro_batch_size is None
    assert (for_device(typed, "cuda").micro_batch_size, for_device(typed, "cuda").grad_accum) == (
        4,
        4,
    )
    args = build_parser().parse_args(["--grad-accum", "32", "--gpu-micro-batch-size", "8"])
    both = for_device(config_from_args(args), "cuda:1")
    assert (both.micro_batch_size, both.grad_accum) == (8, 4)


def test_a_gpu_micro_batch_that_does_not_divide_the_batch_per_process_is_named():
    with pytest.raises(ConfigError, match=r"--gpu-micro-batch-size 5 .* = 16") as exc:
        make_config("default", {"gpu_micro_batch_size": 5})
    assert exc.value.param == "gpu_micro_batch_size"
