"""Training windows (which hidden state pairs with which tokens), the loss, held-out metrics."""

import math

import torch
import torch.nn.functional as F

from redraft.train.losses import EvalAccumulator, drafter_loss, make_windows, target_next_positions
from redraft.train.step import heldout_target, target_greedy, target_hidden


def test_windows_pair_hidden_t_with_tokens_t1_and_targets_t2():
    ids = torch.arange(100, 112)[None]  # [1, 12]
    mask = torch.zeros(1, 12, dtype=torch.long)
    mask[0, 6:10] = 1  # assistant tokens at positions 6..9
    w = make_windows(ids, mask, n=3)
    # position t has a target ids[t+2+i] in 6..9 for some i <= 2  ->  t in 2..7
    assert w.pos_idx.tolist() == [2, 3, 4, 5, 6, 7]
    for p, t in enumerate(w.pos_idx.tolist()):
        assert w.tokens[p].tolist() == [100 + t + 1, 100 + t + 2, 100 + t + 3]
        assert w.targets[p].tolist() == [100 + t + 2, 100 + t + 3, 100 + t + 4]
        assert w.valid[p].tolist() == [6 <= t + 2 + i <= 9 for i in range(3)]


def test_windows_never_cross_the_sequence_end_or_padding():
    ids = torch.tensor([[5, 6, 7, 8, 0, 0], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    w = make_windows(ids, mask, n=4)
    assert w.valid.any(-1).all()  # only windows with something to learn
    # row 0: the last valid target is position 3; no valid step reaches past it
    for p in (w.batch_idx == 0).nonzero().flatten().tolist():
        t = int(w.pos_idx[p])
        assert all(not v or t + 2 + i <= 3 for i, v in enumerate(w.valid[p].tolist()))
    b, j = target_next_positions(w, ids.shape[1])
    assert int(j.max()) <= ids.shape[1] - 1


def test_loss_respects_mask_and_is_mean_over_steps_of_masked_ce():
    torch.manual_seed(0)
    P, n, V = 7, 3, 11
    logits = torch.randn(P, n, V, requires_grad=True)
    targets = torch.randint(0, V, (P, n))
    valid = torch.rand(P, n) > 0.4
    valid[0] = True
    loss, stats = drafter_loss(logits, targets, valid)
    ce = F.cross_entropy(logits.detach().flatten(0, 1), targets.flatten(), reduction="none").view(
        P, n
    )
    per_step = [(ce[:, i][valid[:, i]]).mean() for i in range(n) if valid[:, i].any()]
    torch.testing.assert_close(loss.detach(), torch.stack(per_step).mean())
    loss.backward()
    assert (logits.grad[~valid] == 0).all() and (logits.grad[valid].abs().sum(-1) > 0).all()
    # a target under the mask may be anything
    other = torch.where(valid, targets, (targets + 1) % V)
    torch.testing.assert_close(drafter_loss(logits.detach(), other, valid)[0], loss.detach())


def test_out_of_draft_vocab_targets_are_skipped_by_ce():
    logits = torch.randn(2, 1, 5)
    loss_a, _ = drafter_loss(logits, torch.tensor([[3], [-1]]), torch.ones(2, 1, dtype=torch.bool))
    ce = F.cross_entropy(logits[0], torch.tensor([3]))
    torch.testing.assert_close(loss_a, ce / 2)  # counted in the mean, contributes nothing


def test_kd_term_is_kl_to_the_target():
    torch.manual_seed(1)
    logits = torch.randn(4, 2, 6)
    valid = torch.ones(4, 2, dtype=torch.bool)
    same = logits.log_softmax(-1)
    loss, _ = drafter_loss(
        logits, torch.zeros(4, 2, dtype=torch.long), valid, same, ce_weight=0.0, kd_weight=1.0
    )
    assert abs(float(loss)) < 1e-6
    other = torch.randn(4, 2, 6).log_softmax(-1)
    loss, _ = drafter_loss(
        logits, torch.zeros(4, 2, dtype=torch.long), valid, other, ce_weight=0.0, kd_weight=1.0
    )
    kl = F.kl_div(logits.log_softmax(-1), other, log_target=True, reduction="none").sum(-1).mean()
    torch.testing.assert_close(loss, kl)


def test_eval_chain_accuracy_and_tau():
    V = 10
    # 3 positions, n = 3; top-1 is argmax of one-hot logits
    pred = torch.tensor([[1, 2, 3], [1, 9, 3], [4, 4, 4]])
    data = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 4, 5]])
    greedy = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 4, 4]])
    logits = F.one_hot(pred, V).float()
    valid = torch.ones(3, 3, dtype=torch.bool)
    acc = EvalAccumulator(3)
    acc.add(logits, data, greedy, data == greedy, valid)
    r = acc.result()
    assert r["eval_top1"] == [1.0, 2 / 3, 2 / 3]
    assert r["eval_chain_acc_data"] == [1.0, 2 / 3, 1 / 3]
    # vs target: position 2 step 2 predicts the greedy token 4 but the data says 5 -> chain stops
    assert r["eval_top1_target"] == [1.0, 2 / 3, 1.0]
    assert r["eval_chain_acc"] == [1.0, 2 / 3, 1 / 3]
    assert math.isclose(r["eval_tau_est"], 1 + 1.0 + 2 / 3 + 1 / 3)


def test_target_greedy_windows_line_up_with_the_targets_own_continuation(tiny_target):
    """On the target's own greedy output, the target's token for every window target IS the data."""
    prompt = torch.tensor([[5, 17, 42, 8]])
    with torch.no_grad():
        seq = tiny_target.model.generate(prompt, max_new_tokens=12, do_sample=False)
    mask = torch.zeros_like(seq)
    mask[0, prompt.shape[1] :] = 1
    hidden = target_hidden(tiny_target, seq, "fp32")
    greedy = target_greedy(tiny_target, hidden, "fp32")
    w = make_windows(seq, mask, n=4)
    b, j = target_next_positions(w, seq.shape[1])
    assert torch.equal(greedy[b, j][w.valid], w.targets[w.valid])
    assert w.valid.sum() > 20


def test_heldout_greedy_is_the_float32_decoders_not_bf16_autocasts(tiny_target):
    """Held-out metrics compare the head with the target's greedy tokens as the decoder makes
    them (float32 on a CPU), even when training autocasts the target to bf16: there near-ties
    flip, and a flipped token would count as a miss of the data the target itself wrote."""
    torch.manual_seed(0)
    prompts = torch.randint(3, tiny_target.config.vocab_size, (8, 4))
    with torch.no_grad():
        seq = tiny_target.model.generate(prompts, max_new_tokens=40, do_sample=False)
    data = seq[:, 4:]  # the float32 greedy continuation: what the target wrote
    _, greedy = heldout_target(tiny_target, seq)
    assert torch.equal(greedy[:, 3:-1], data)
    # the premise: bf16 autocast flips some of these (else the check above could not fail)
    bf16 = target_greedy(tiny_target, target_hidden(tiny_target, seq, "amp-bf16"), "amp-bf16")
    assert not torch.equal(bf16[:, 3:-1], data)
