"""Recipes, overrides, DeepSpeed configs, schedule, data order."""

import numpy as np
import pytest
import torch

from redraft.errors import ConfigError
from redraft.train.cli import build_parser, config_from_args
from redraft.train.config import RECIPES_DIR, TrainConfig, load_recipe, make_config
from redraft.train.batches import draft_vocab_from_data, epoch_batches
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
    args = build_parser().parse_args(["--recipe", "tiny", "--lr", "5e-4", "--no-rnn",
                                      "--set", "max_steps=7", "--adam-betas", "0.8", "0.95"])
    cfg = config_from_args(args)
    tiny = load_recipe("tiny")
    assert cfg.lr == 5e-4 and cfg.rnn is False and cfg.max_steps == 7 and cfg.adam_betas == (0.8, 0.95)
    assert cfg.num_steps == tiny["num_steps"] != TrainConfig().num_steps  # untouched recipe keys stay


def test_bad_values_are_errors():
    with pytest.raises(ConfigError, match="loss"):
        make_config(None, {"loss": "mse"})
    with pytest.raises(ConfigError, match="micro_batch_size"):
        make_config(None, {"micro_batch_size": "two"})


def test_deepspeed_config_fills_auto_values_and_rejects_conflicts(tmp_path):
    cfg = make_config("tiny", {"zero_stage": 2, "grad_accum": 3})
    ds = deepspeed_config(cfg, "bf16")
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["gradient_accumulation_steps"] == 3 and ds["train_micro_batch_size_per_gpu"] == cfg.micro_batch_size
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

    ds = datasets.Dataset.from_dict({
        "input_ids": [[7, 7, 7, 7, 3, 3, 5], [3, 9, 9]],
        "loss_mask": [[0, 0, 0, 1, 1, 1, 1], [1, 1, 1]],  # 7 is frequent but mostly unmasked
    })
    ids = draft_vocab_from_data(ds, vocab_size=12, size=3)
    assert ids.tolist() == [3, 9, 5]
