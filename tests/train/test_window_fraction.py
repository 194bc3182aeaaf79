"""``window_fraction``: a training step learns a random share of its windows."""

import pytest
import torch

from redraft.errors import ConfigError
from redraft.models.redrafter import ReDrafter, ReDrafterConfig
from redraft.train.config import make_config
from redraft.train.losses import learn_positions
from redraft.train.step import batch_loss, sample_windows
from tests.train.test_kd_positions import N_STEPS, _batch


def test_sample_windows_keeps_a_share_of_the_positions_in_order():
    b = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    t = torch.tensor([3, 4, 5, 6, 0, 1, 2, 3, 4, 5])
    torch.manual_seed(0)
    sb, st = sample_windows((b, t), 0.5)
    pairs = list(zip(sb.tolist(), st.tolist()))
    assert len(pairs) == 5 and len(set(pairs)) == 5
    assert set(pairs) <= set(zip(b.tolist(), t.tolist()))
    assert pairs == sorted(pairs)  # the batch's order kept
    torch.manual_seed(0)
    assert torch.equal(sample_windows((b, t), 0.5)[1], st)  # the seed decides
    draws = {tuple(sample_windows((b, t), 0.5)[1].tolist()) for _ in range(20)}
    assert len(draws) > 1  # and a new draw each step
    assert sample_windows((b, t), 0.01)[0].numel() == 1  # at least one
    full = (b, t)
    assert sample_windows(full, 1.0) is full


def test_a_training_step_learns_the_sampled_windows_only(tiny_target, monkeypatch):
    import redraft.train.step as step

    torch.manual_seed(0)
    model = ReDrafter(ReDrafterConfig.for_target(tiny_target, num_layers=1, num_steps=N_STEPS))
    model.attach_target(tiny_target)
    batch = _batch(tiny_target)
    seen = []
    make = step.make_windows
    monkeypatch.setattr(
        step, "make_windows", lambda *a, **k: seen.append(make(*a, **k)) or seen[-1]
    )

    def loss(fraction):
        cfg = make_config(
            "tiny", {"num_steps": N_STEPS, "draft_vocab_size": None, "window_fraction": fraction}
        )
        return float(batch_loss(model, model, tiny_target, batch, cfg, "fp32")[0])

    full = loss(1.0)
    b, t = learn_positions(batch.mask, N_STEPS)
    assert len(seen[0]) == len(b)
    halves = [loss(0.5) for _ in range(12)]
    for w in seen[1:]:
        assert len(w) == round(0.5 * len(b))
        assert set(zip(w.batch_idx.tolist(), w.pos_idx.tolist())) <= set(
            zip(b.tolist(), t.tolist())
        )
    assert len(set(halves)) > 1 and all(h != full for h in halves)


def test_window_fraction_is_checked():
    assert make_config("tiny").window_fraction == 1.0
    for bad in (0, 1.5, -0.2):
        with pytest.raises(ConfigError, match="window.fraction"):
            make_config("tiny", {"window_fraction": bad})
