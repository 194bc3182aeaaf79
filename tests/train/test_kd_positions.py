"""``kd_positions: all``: the KL term also learns the prompt tokens; the cross-entropy does not."""

import pytest
import torch

from redraft.errors import ConfigError
from redraft.models.redrafter import ReDrafter, ReDrafterConfig
from redraft.train.batches import Batch
from redraft.train.config import make_config
from redraft.train.losses import make_windows
from redraft.train.step import batch_loss, target_hidden

N_STEPS = 3


def test_windows_with_a_kd_mask_add_the_prompt_positions_and_keep_valid():
    ids = torch.arange(100, 112)[None]  # [1, 12]
    mask = torch.zeros(1, 12, dtype=torch.long)
    mask[0, 6:10] = 1  # assistant tokens at 6..9; 10, 11 are real too (say an end-of-turn)
    plain = make_windows(ids, mask, n=3)
    w = make_windows(ids, mask, n=3, kd_mask=torch.ones(1, 12, dtype=torch.long))
    assert plain.kd_valid is None
    # every t whose first target t+2 lies inside the sequence: 0..9
    assert w.pos_idx.tolist() == list(range(10))
    for p, t in enumerate(w.pos_idx.tolist()):
        assert w.valid[p].tolist() == [6 <= t + 2 + i <= 9 for i in range(3)]
        assert w.kd_valid[p].tolist() == [t + 2 + i <= 11 for i in range(3)]


def _batch(target):
    """Two chat-like rows of the tiny target: assistant tokens late, row 1 padded after 11."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, target.vocab_size, (2, 16), generator=g)
    lengths = torch.tensor([16, 11])
    ids[1, 11:] = 0
    mask = torch.zeros(2, 16, dtype=torch.long)
    mask[0, 10:15], mask[1, 7:10] = 1, 1
    return Batch(ids, mask, tokens=27, loss_tokens=int(mask[:, 2:].sum()), lengths=lengths)


def _loss(model, target, batch, impl="fused", **over):
    cfg = make_config(
        "tiny",
        {"num_steps": N_STEPS, "kd_top_k": target.vocab_size, "draft_vocab_size": None, **over},
    )
    return float(batch_loss(model, model, target, batch, cfg, "fp32", impl=impl)[0])


def _reference_kd(model, target, batch, counts) -> float:
    """Mean over steps of each step's mean KL(target || head) over the targets where
    ``counts(b, j)`` (j = the target's index), written out position by position."""
    hidden = target_hidden(target, batch.ids, "fp32")  # [B, T, H]
    with torch.no_grad():
        teacher = target.output_head(hidden).float().log_softmax(-1)  # full softmax: k = vocab
    T = batch.ids.shape[1]
    per_step = [[] for _ in range(N_STEPS)]
    for b in range(batch.ids.shape[0]):
        L = int(batch.lengths[b])
        for t in range(T):
            tokens = torch.cat([batch.ids[b, t + 1 :], batch.ids.new_zeros(N_STEPS)])[:N_STEPS]
            with torch.no_grad():
                logp = model(hidden[b, t][None], tokens[None])[0].float().log_softmax(-1)  # [n, V]
            for i in range(N_STEPS):
                j = t + 2 + i
                if j < L and counts(b, j):
                    p = teacher[b, j - 1]
                    per_step[i].append(float((p.exp() * (p - logp[i])).sum()))
    means = [sum(v) / len(v) for v in per_step if v]
    return sum(means) / len(means)


def test_kd_on_every_position_counts_the_prompts_and_ce_stays_on_assistant_tokens(tiny_target):
    torch.manual_seed(0)
    model = ReDrafter(ReDrafterConfig.for_target(tiny_target, num_layers=1, num_steps=N_STEPS))
    model.attach_target(tiny_target)
    batch = _batch(tiny_target)
    kd_assistant = _loss(model, tiny_target, batch, loss="kd", kd_positions="assistant")
    kd_all = _loss(model, tiny_target, batch, loss="kd", kd_positions="all")
    # the values, recomputed target by target from their definitions
    ref_assistant = _reference_kd(model, tiny_target, batch, lambda b, j: batch.mask[b, j] == 1)
    ref_all = _reference_kd(model, tiny_target, batch, lambda b, j: True)
    assert kd_assistant == pytest.approx(ref_assistant, rel=1e-4)
    assert kd_all == pytest.approx(ref_all, rel=1e-4)
    assert abs(kd_all - kd_assistant) > 1e-3  # the prompt positions changed the value
    # the dense reference loss agrees with the fused one
    dense = _loss(model, tiny_target, batch, impl="dense", loss="kd", kd_positions="all")
    assert dense == pytest.approx(kd_all, rel=1e-5)

    # ce+kd = ce + kd, each term its own mean: the CE term is the same assistant-only CE
    ce = _loss(model, tiny_target, batch, loss="ce", kd_positions="all")
    ce_assistant = _loss(model, tiny_target, batch, loss="ce", kd_positions="assistant")
    assert ce == ce_assistant
    both = _loss(model, tiny_target, batch, loss="ce+kd", kd_positions="all", kd_weight=2.0)
    assert both == pytest.approx(ce + 2.0 * kd_all, rel=1e-5)
    dense_both = _loss(
        model, tiny_target, batch, impl="dense", loss="ce+kd", kd_positions="all", kd_weight=2.0
    )
    assert dense_both == pytest.approx(both, rel=1e-5)
    # ... and differs from a CE that also counted the prompt positions (their labels are text)
    prompts_too = Batch(
        batch.ids, (batch.ids * 0 + 1) * (torch.arange(16) < batch.lengths[:, None]), 27, 0
    )
    ce_everywhere = _loss(model, tiny_target, prompts_too, loss="ce")
    assert abs(ce_everywhere - ce) > 1e-3


def test_kd_positions_all_learns_the_prompt_positions(tiny_target):
    """A gradient step from ``all`` moves the head's output on a prompt-only window;
    ``assistant`` gives it no gradient there."""
    batch = _batch(tiny_target)
    grads = {}
    for where in ("assistant", "all"):
        torch.manual_seed(0)
        model = ReDrafter(ReDrafterConfig.for_target(tiny_target, num_layers=1, num_steps=1))
        model.attach_target(tiny_target)
        cfg = make_config(
            "tiny", {"num_steps": 1, "loss": "kd", "kd_positions": where, "draft_vocab_size": None}
        )
        # only the prompt of row 0 (positions 0..9): no assistant target at all
        prompt = Batch(
            batch.ids[:1, :10],
            torch.zeros(1, 10, dtype=torch.long),
            10,
            0,
            lengths=torch.tensor([10]),
        )
        loss = batch_loss(model, model, tiny_target, prompt, cfg, "fp32")[0]
        if loss.requires_grad:
            loss.backward()
        grads[where] = float(
            sum(p.grad.abs().sum() for p in model.parameters() if p.grad is not None)
        )
    assert grads["assistant"] == 0 and grads["all"] > 0


def test_kd_positions_is_checked():
    assert make_config("tiny").kd_positions == "assistant"
    assert make_config("tiny", {"kd_positions": "all"}).kd_positions == "all"
    with pytest.raises(ConfigError, match="kd.positions"):
        make_config("tiny", {"kd_positions": "prompts"})


@pytest.mark.parametrize("kd_positions", ["assistant", "all"])
def test_windows_picked_on_the_host_copy_give_the_same_loss(tiny_target, monkeypatch, kd_positions):
    """A batch moved to a device keeps its CPU copy (``Batch.host``) and the loss takes its
    window positions from there (no ``nonzero`` on the device: a sync per micro step on CUDA);
    the positions and the loss are the ones found on the batch itself."""
    import redraft.train.step as step
    from redraft.train.losses import learn_positions, real_token_mask

    torch.manual_seed(0)
    model = ReDrafter(ReDrafterConfig.for_target(tiny_target, num_layers=1, num_steps=N_STEPS))
    model.attach_target(tiny_target)
    plain = _batch(tiny_target)
    twin = Batch(**{**vars(plain), "host": _batch(tiny_target)})  # "moved", with its CPU copy
    seen = []
    make = step.make_windows
    monkeypatch.setattr(
        step, "make_windows", lambda *a, **k: seen.append(k.get("positions")) or make(*a, **k)
    )
    over = {"loss": "ce+kd", "kd_positions": kd_positions}
    assert _loss(model, tiny_target, twin, **over) == _loss(model, tiny_target, plain, **over)
    assert seen[0] is not None and seen[1] is None  # the host copy's positions, then none
    kd = real_token_mask(plain.ids, plain.lengths) if kd_positions == "all" else None
    want = make(plain.ids, plain.mask, N_STEPS, kd_mask=kd)
    b, t = learn_positions(plain.mask, N_STEPS, kd)
    assert b.tolist() == want.batch_idx.tolist() and t.tolist() == want.pos_idx.tolist()
    assert torch.equal(seen[0][0], want.batch_idx) and torch.equal(seen[0][1], want.pos_idx)


def test_a_batch_moved_to_cpu_is_itself_and_keeps_no_copy(tiny_target):
    batch = _batch(tiny_target)
    assert batch.to("cpu") is batch and batch.host is None
