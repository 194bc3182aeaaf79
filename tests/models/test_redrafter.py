"""The ReDrafter head: equations, shapes, forward/step agreement, artifacts."""

import pytest
import torch
import torch.nn.functional as F

from redraft.errors import ArtifactError, FingerprintMismatchError, RedraftError
from redraft.models.redrafter import ReDrafter, ReDrafterConfig, load_drafter


def _drafter(target, seed=0, **kw):
    torch.manual_seed(seed)
    d = ReDrafter(ReDrafterConfig.for_target(target, **kw)).attach_target(target)
    with torch.no_grad():  # larger weights than the 0.02 init so differences are not tiny
        for p in d.parameters():
            p.normal_(0, 0.3)
    return d


def test_config_records_target(tiny_target):
    cfg = ReDrafterConfig.for_target(tiny_target)
    assert cfg.model_type == "redrafter"
    assert cfg.hidden_size == tiny_target.hidden_size
    assert cfg.vocab_size == tiny_target.vocab_size
    assert cfg.tokenizer_fingerprint == tiny_target.fingerprint
    assert cfg.target_model == tiny_target.model_id
    assert cfg.draft_vocab_size is None and cfg.out_vocab_size == cfg.vocab_size


def test_rnn_equations_match_manual_computation(tiny_target):
    d = _drafter(tiny_target)
    N, L = 3, 4
    ctx = torch.randn(N, d.config.hidden_size)
    tokens = torch.randint(0, d.config.vocab_size, (N, L))
    logits = d(ctx, tokens)
    assert logits.shape == (N, L, d.config.vocab_size)

    E = tiny_target.input_embedding.weight
    U, b, W = d.rnn_u.weight, d.rnn_u.bias, d.rnn_w.weight
    s = torch.zeros(N, d.config.state_size)
    for i in range(L):
        s = F.silu(s @ U.T + E[tokens[:, i]] @ W.T + b)  # s_i = f(U s_{i-1} + W e_i + b), s_{-1}=0
        h = torch.cat([s, ctx], -1)
        for blk in d.blocks:
            h = h + F.silu(h @ blk.linear.weight.T + blk.linear.bias)
        torch.testing.assert_close(logits[:, i], h @ d.lm_head.weight.T, rtol=1e-5, atol=1e-5)


def test_first_state_is_f_of_W_e_plus_b(tiny_target):
    d = _drafter(tiny_target)
    tok = torch.tensor([5, 7])
    s0, _ = d.step(None, torch.zeros(2, d.config.hidden_size), tok)
    E = tiny_target.input_embedding.weight
    torch.testing.assert_close(s0, F.silu(E[tok] @ d.rnn_w.weight.T + d.rnn_u.bias))


def test_no_rnn_ablation_is_running_sum_of_embeddings(tiny_target):
    d = _drafter(tiny_target, rnn=False)
    assert not hasattr(d, "rnn_u") and not hasattr(d, "rnn_w")
    tokens = torch.randint(0, d.config.vocab_size, (2, 5))
    E = tiny_target.input_embedding.weight
    torch.testing.assert_close(d.states(tokens), E[tokens].cumsum(1))


@pytest.mark.parametrize("rnn", [True, False])
def test_forward_and_step_agree(tiny_target, rnn):
    d = _drafter(tiny_target, rnn=rnn, draft_vocab_size=50)
    N, L = 4, 5
    ctx = torch.randn(N, d.config.hidden_size)
    tokens = torch.randint(0, d.config.vocab_size, (N, L))
    full = d(ctx, tokens)
    state, stepped = None, []
    for i in range(L):
        state, lg = d.step(state, ctx, tokens[:, i])
        assert state.shape == (N, d.config.state_size) and lg.shape == (N, 50)
        stepped.append(lg)
    torch.testing.assert_close(torch.stack(stepped, 1), full, rtol=1e-6, atol=1e-6)


def test_forward_broadcasts_leading_dims(tiny_target):
    d = _drafter(tiny_target)
    ctx = torch.randn(2, 3, d.config.hidden_size)
    tokens = torch.randint(0, d.config.vocab_size, (2, 3, 4))
    out = d(ctx, tokens)
    assert out.shape == (2, 3, 4, d.config.vocab_size)
    torch.testing.assert_close(out[1, 2], d(ctx[1, 2], tokens[1, 2]))


def test_embedding_is_shared_frozen_and_not_saved(tiny_target, tmp_path):
    d = _drafter(tiny_target)
    assert all("embed" not in k for k in d.state_dict())
    assert all(p.data_ptr() != tiny_target.input_embedding.weight.data_ptr() for p in d.parameters())
    loss = d(torch.randn(2, d.config.hidden_size), torch.randint(0, 100, (2, 3))).sum()
    loss.backward()
    assert tiny_target.input_embedding.weight.grad is None
    assert d.lm_head.weight.grad is not None


def test_reduced_vocab_maps_ids_both_ways(tiny_target):
    d = _drafter(tiny_target, draft_vocab_size=4)
    d.set_draft_vocab(torch.tensor([10, 3, 200, 7]))
    assert d.to_target_ids(torch.tensor([[0, 1], [2, 3]])).tolist() == [[10, 3], [200, 7]]
    assert d.to_draft_ids(torch.tensor([3, 7, 11, 10, -100])).tolist() == [1, 3, -1, 0, -100]
    with pytest.raises(RedraftError):
        d.set_draft_vocab(torch.tensor([1, 1, 2, 3]))


def test_full_vocab_ids_are_identity(tiny_target):
    d = _drafter(tiny_target)
    ids = torch.tensor([1, 2, 300])
    assert torch.equal(d.to_target_ids(ids), ids) and torch.equal(d.to_draft_ids(ids), ids)


def test_save_load_round_trip(tiny_target, tmp_path):
    d = _drafter(tiny_target, draft_vocab_size=8)
    d.set_draft_vocab(torch.tensor([9, 8, 7, 6, 5, 4, 3, 2]))
    d.save_pretrained(tmp_path / "head")
    loaded = load_drafter(tmp_path / "head", tiny_target)
    assert not loaded.training
    assert loaded.config.draft_vocab_size == 8
    assert torch.equal(loaded.draft_to_target, d.draft_to_target)
    ctx, tokens = torch.randn(3, d.config.hidden_size), torch.randint(0, 384, (3, 5))
    torch.testing.assert_close(loaded(ctx, tokens), d(ctx, tokens), rtol=0, atol=0)


def test_load_for_other_tokenizer_names_both_fingerprints(tiny_target, llama2_target_dir, tmp_path):
    from redraft.models import load_target

    d = _drafter(tiny_target)
    d.save_pretrained(tmp_path / "head")
    other = load_target(str(llama2_target_dir), dtype="float32", device="cpu")
    with pytest.raises(FingerprintMismatchError) as exc:
        load_drafter(tmp_path / "head", other)
    assert tiny_target.fingerprint in str(exc.value) and other.fingerprint in str(exc.value)


def test_missing_artifact_and_missing_embedding_are_actionable(tiny_target, tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        load_drafter(tmp_path / "nope", tiny_target)
    bare = ReDrafter(ReDrafterConfig.for_target(tiny_target))
    with pytest.raises(RedraftError, match="attach_target"):
        bare(torch.randn(1, bare.config.hidden_size), torch.tensor([[1]]))
