"""``feature_weight``: EAGLE's feature regression, the output layer's input at draft step i
against the target's hidden state that predicts the same token."""

import pytest
import torch

from redraft.errors import ConfigError
from redraft.models.redrafter import ReDrafter, ReDrafterConfig
from redraft.train.batches import Batch
from redraft.train.config import make_config
from redraft.train.step import batch_loss, target_hidden

N_STEPS = 3


def _setup(target):
    torch.manual_seed(0)
    model = ReDrafter(ReDrafterConfig.for_target(target, num_layers=1, num_steps=N_STEPS))
    model.attach_target(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, target.vocab_size, (2, 14), generator=g)
    mask = torch.zeros(2, 14, dtype=torch.long)
    mask[0, 8:13], mask[1, 5:9] = 1, 1
    batch = Batch(ids, mask, tokens=28, loss_tokens=int(mask[:, 2:].sum()))
    return model, batch


def _loss(model, target, batch, impl="fused", **over):
    cfg = make_config("tiny", {"num_steps": N_STEPS, "draft_vocab_size": None, **over})
    return batch_loss(model, model, target, batch, cfg, "fp32", impl=impl)


def test_the_term_is_the_smooth_l1_to_the_hidden_state_of_the_same_token(tiny_target):
    model, batch = _setup(tiny_target)
    base = _loss(model, tiny_target, batch)[0]
    loss, stats, _, win, _ = _loss(model, tiny_target, batch, feature_weight=0.5)
    # recomputed window by window: step i of the window at t predicts token t+2+i, which the
    # target's hidden state at t+1+i predicts
    hidden = target_hidden(tiny_target, batch.ids, "fp32")  # [B, T, H]
    H = hidden.shape[-1]
    terms = []
    for p in range(len(win)):
        b, t = int(win.batch_idx[p]), int(win.pos_idx[p])
        with torch.no_grad():
            feats = model(hidden[b, t][None], win.tokens[p][None], return_features=True)[0]
        for i in range(N_STEPS):
            if win.valid[p, i]:
                diff = torch.nn.functional.smooth_l1_loss(feats[i, -H:], hidden[b, t + 1 + i])
                terms.append(float(diff))
    ref = sum(terms) / len(terms)
    assert float(stats["feature_loss"]) == pytest.approx(ref, rel=1e-4)
    assert float(loss.detach()) == pytest.approx(float(base.detach()) + 0.5 * ref, rel=1e-4)
    assert ref > 0.01  # an untrained head does not predict the hidden states


def test_the_term_trains_the_x_half_toward_the_hidden_states(tiny_target):
    """The same steps with and without the term: with it, the head's features come far closer
    to the target's hidden states (its gradient reaches the head)."""
    after = {}
    for w in (0.0, 1.0):
        model, batch = _setup(tiny_target)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(25):
            loss, *_ = _loss(model, tiny_target, batch, feature_weight=w)
            opt.zero_grad()
            loss.backward()
            opt.step()
        after[w] = float(_loss(model, tiny_target, batch, feature_weight=1.0)[1]["feature_loss"])
    assert after[1.0] < 0.5 * after[0.0]


def test_the_dense_loss_refuses_it(tiny_target):
    model, batch = _setup(tiny_target)
    with pytest.raises(ConfigError, match="feature_weight"):
        _loss(model, tiny_target, batch, impl="dense", feature_weight=1.0)
