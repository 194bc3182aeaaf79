"""``step_decay``: a training step weights draft step i's mean loss by decay**i (mean 1)."""

import pytest
import torch

from redraft.errors import ConfigError
from redraft.models.losses import step_decay_factors
from redraft.models.redrafter import ReDrafter, ReDrafterConfig
from redraft.train.config import make_config
from redraft.train.step import batch_loss
from tests.train.test_kd_positions import N_STEPS, _batch


@pytest.mark.parametrize("impl", ["fused", "dense"])
def test_a_training_step_weights_the_steps_by_the_decay(tiny_target, impl):
    torch.manual_seed(0)
    model = ReDrafter(ReDrafterConfig.for_target(tiny_target, num_layers=1, num_steps=N_STEPS))
    model.attach_target(tiny_target)
    batch = _batch(tiny_target)

    def run(decay):
        cfg = make_config(
            "tiny",
            {"num_steps": N_STEPS, "draft_vocab_size": None, "loss": "ce+kd", "step_decay": decay},
        )
        loss, stats, *_ = batch_loss(model, model, tiny_target, batch, cfg, "fp32", impl=impl)
        return float(loss.detach()), stats

    plain, stats = run(1.0)
    decayed, stats_d = run(0.5)
    per_step, count = stats["step_loss"].double(), stats["step_count"]
    assert (count > 0).all()  # every step has positions: the factors are 0.5**i / mean
    r = step_decay_factors(count > 0, 0.5).double()
    torch.testing.assert_close(r, torch.tensor([4, 2, 1], dtype=torch.float64) * 3 / 7)
    assert plain == pytest.approx(float(per_step.mean()), rel=1e-5)
    assert decayed == pytest.approx(float((r * per_step).mean()), rel=1e-5)
    assert abs(decayed - plain) > 1e-4 * plain  # (a random head: its steps lose alike)
    torch.testing.assert_close(stats_d["step_loss"], stats["step_loss"], rtol=1e-5, atol=1e-6)


def test_step_decay_is_checked():
    for bad in ("0", "1.5", "-0.2"):
        with pytest.raises(ConfigError, match="--step-decay"):
            make_config("tiny", {"step_decay": bad})
