"""The ReDrafter head: equations, shapes, forward/step agreement, artifacts."""

import pytest
import torch
import torch.nn.functional as F

from redraft.errors import ArtifactError, FingerprintMismatchError, RedraftError
from redraft.models.drafter_io import load_drafter
from redraft.models.redrafter import ReDrafter, ReDrafterConfig


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
    assert all(
        p.data_ptr() != tiny_target.input_embedding.weight.data_ptr() for p in d.parameters()
    )
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


# ------------------------------------------------------------------ a drafter loads exactly or fails


def _tamper(head_dir, change, keep_sha=False):
    """Rewrite ``head_dir/model.safetensors`` with ``change(tensors)`` applied; drop the recorded
    sha256 unless ``keep_sha`` (an artifact written by another tool, so that the layout check
    itself is what must catch it)."""
    import json

    from safetensors.torch import load_file, save_file

    t = load_file(str(head_dir / "model.safetensors"))
    change(t)
    save_file(t, str(head_dir / "model.safetensors"), metadata={"format": "pt"})
    if not keep_sha:
        cfg = json.loads((head_dir / "config.json").read_text())
        cfg.pop("weights_sha256")
        (head_dir / "config.json").write_text(json.dumps(cfg))


def _edit_config(head_dir, **values):
    import json

    cfg = json.loads((head_dir / "config.json").read_text())
    cfg.update(values)
    (head_dir / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def head_dir(tiny_target, tmp_path):
    _drafter(tiny_target).save_pretrained(tmp_path / "head")
    return tmp_path / "head"


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda t: t.pop("blocks.1.linear.bias"), r"missing tensors blocks\.1\.linear\.bias"),
        (lambda t: t.update(extra=torch.zeros(3)), r"unexpected tensors extra"),
        (lambda t: t.update({"rnn_u.bias": torch.zeros(7)}), r"rnn_u\.bias has shape \[7\]"),
    ],
)
def test_weights_that_disagree_with_the_config_name_the_key(tiny_target, head_dir, change, says):
    _tamper(head_dir, change)
    with pytest.raises(ArtifactError, match=says):  # checked before the (missing) sha256
        load_drafter(head_dir, tiny_target)


def test_config_with_more_layers_than_the_weights_names_the_missing_layer(tiny_target, head_dir):
    _edit_config(head_dir, num_layers=3)
    with pytest.raises(
        ArtifactError, match=r"missing tensors blocks\.2\.linear\.weight.*num_layers=3"
    ):
        load_drafter(head_dir, tiny_target)


def test_auto_model_is_as_strict(head_dir):
    from transformers import AutoModel

    _edit_config(head_dir, num_layers=1)
    with pytest.raises(ArtifactError, match=r"unexpected tensors blocks\.1\.linear\.bias"):
        AutoModel.from_pretrained(head_dir)


@pytest.mark.parametrize(
    "key, value",
    [
        ("num_layers", "2"),
        ("hidden_size", 32.0),
        ("rnn", "yes"),
        ("tokenizer_fingerprint", 5),
        ("num_steps", 0),
        ("activation", "swishy"),
        ("draft_vocab_size", True),
    ],
)
def test_config_values_of_the_wrong_type_name_the_key(tiny_target, head_dir, key, value):
    _edit_config(head_dir, **{key: value})
    with pytest.raises(ArtifactError, match=rf"config\.json.*{key}"):
        load_drafter(head_dir, tiny_target)


def test_non_finite_weights_are_refused(tiny_target, tmp_path):
    d = _drafter(tiny_target)
    with torch.no_grad():
        d.blocks[0].linear.weight[3, 4] = float("nan")
    d.save_pretrained(
        tmp_path / "head"
    )  # the sha256 is recorded: only the value check can catch it
    with pytest.raises(ArtifactError, match=r"blocks\.0\.linear\.weight holds 1 non-finite"):
        load_drafter(tmp_path / "head", tiny_target)


def test_sha256_is_recorded_at_write_time_and_checked_on_load(tiny_target, head_dir):
    import json

    from redraft.utils import sha256_file

    recorded = json.loads((head_dir / "config.json").read_text())["weights_sha256"]
    assert recorded == {"model.safetensors": sha256_file(head_dir / "model.safetensors")}
    data = bytearray((head_dir / "model.safetensors").read_bytes())
    data[-5] ^= 0x01  # one bit of one weight, same size, still a valid safetensors file
    (head_dir / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="does not match the sha256"):
        load_drafter(head_dir, tiny_target)
    load_drafter(head_dir, tiny_target, verify=False)  # the escape hatch loads it


def test_old_artifact_without_a_sha256_loads_with_a_warning(tiny_target, head_dir):
    d = load_drafter(head_dir, tiny_target)
    _tamper(head_dir, lambda t: None)  # same tensors, no recorded sha256
    with pytest.warns(UserWarning, match="records no weights_sha256"):
        old = load_drafter(head_dir, tiny_target)
    assert all(
        torch.equal(a, b) for a, b in zip(d.state_dict().values(), old.state_dict().values())
    )


def test_truncated_weights_and_broken_config_are_actionable(tiny_target, head_dir):
    data = (head_dir / "model.safetensors").read_bytes()
    (head_dir / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="not a complete safetensors file"):
        load_drafter(head_dir, tiny_target)
    (head_dir / "config.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        load_drafter(head_dir, tiny_target)
