"""The head as a transformers-native model: Auto classes, auto_map, forward(labels=...), push_to_hub."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard, RepoUrl
from huggingface_hub.errors import EntryNotFoundError
from transformers import AutoConfig, AutoModel

from redraft.models.drafter_io import load_drafter
from redraft.models.redrafter import ReDrafter, ReDrafterConfig, ReDrafterOutput

REPO = Path(__file__).resolve().parents[2]


def _head(target=None, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = (
        ReDrafterConfig.for_target(target, **kw)
        if target is not None
        else ReDrafterConfig(
            hidden_size=16, vocab_size=50, num_steps=3, tokenizer_fingerprint="fp-x", **kw
        )
    )
    d = ReDrafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.3)
    return d


def _equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_auto_classes_return_the_head(tmp_path):
    d = _head(draft_vocab_size=20)
    d.save_pretrained(tmp_path)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert (
        type(cfg) is ReDrafterConfig
        and cfg.draft_vocab_size == 20
        and cfg.tokenizer_fingerprint == "fp-x"
    )
    m = AutoModel.from_pretrained(tmp_path)
    assert type(m) is ReDrafter and _equal(m, d)


def test_saved_config_has_auto_map_to_a_shim_of_redrafts_own_classes(tmp_path):
    _head().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["auto_map"] == {
        "AutoConfig": "redraft_head.ReDrafterConfig",
        "AutoModel": "redraft_head.ReDrafter",
    }
    assert (
        "from redraft.models.redrafter import ReDrafter, ReDrafterConfig"
        in (tmp_path / "redraft_head.py").read_text()
    )


def _fresh_python(code: str, tmp_path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(
        PYTHONPATH=str(REPO), HF_MODULES_CACHE=str(tmp_path / "hf-modules"), HF_HUB_OFFLINE="1"
    )
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_import_redraft_alone_registers_the_auto_classes(tmp_path):
    """A fresh process: `import redraft` loads neither torch nor transformers, and AutoModel still
    knows the head when transformers' Auto classes load later."""
    _head().save_pretrained(tmp_path / "head")
    out = _fresh_python(
        f"""
        import sys
        import redraft
        assert "torch" not in sys.modules and "transformers" not in sys.modules
        from transformers import AutoModel
        m = AutoModel.from_pretrained({str(tmp_path / "head")!r})
        print(type(m).__module__, type(m).__name__)
    """,
        tmp_path,
    )
    assert out == "redraft.models.redrafter ReDrafter"


def test_trust_remote_code_loads_the_head_without_importing_redraft_first(tmp_path):
    d = _head()
    d.save_pretrained(tmp_path / "head")
    out = _fresh_python(
        f"""
        from transformers import AutoModel
        m = AutoModel.from_pretrained({str(tmp_path / "head")!r}, trust_remote_code=True)
        print(type(m).__module__, type(m).__name__, float(m.lm_head.weight.detach().double().sum()))
    """,
        tmp_path,
    )
    mod, name, total = out.split()
    assert (mod, name) == ("redraft.models.redrafter", "ReDrafter")
    assert float(total) == pytest.approx(float(d.lm_head.weight.detach().double().sum()), abs=1e-9)


def test_forward_with_labels_returns_the_trainers_loss(tiny_target):
    from redraft.train.losses import drafter_loss as trainer_loss

    d = _head(tiny_target, draft_vocab_size=64)
    d.set_draft_vocab(torch.arange(100, 164))
    ctx = torch.randn(2, 3, d.config.hidden_size)
    tokens = torch.randint(100, 164, (2, 3, 4))
    labels = torch.randint(100, 164, (2, 3, 4))
    labels[0, 0, 1] = -100  # ignored
    labels[1, 2, 3] = 7  # outside the draft vocabulary: counted, not learnable
    d.attach_target(tiny_target)
    out = d(ctx, tokens, labels=labels)
    assert isinstance(out, ReDrafterOutput) and torch.equal(out.logits, d(ctx, tokens))
    # the trainer's call, by hand: draft ids, -1 outside the vocabulary, the valid mask
    flat = out.logits.reshape(-1, 4, 64)
    lab = labels.reshape(-1, 4)
    valid = lab != -100
    tgt = torch.where(lab >= 100, lab - 100, -1)
    expect, _ = trainer_loss(flat, tgt, valid)
    torch.testing.assert_close(out.loss, expect, rtol=0, atol=0)
    # ...which is the mean over steps of the mean cross-entropy of the learnable labels
    logp = flat.log_softmax(-1)
    steps = []
    for i in range(4):
        v = valid[:, i]
        ok = v & (tgt[:, i] >= 0)
        steps.append(-(logp[ok, i].gather(-1, tgt[ok, i][:, None])).sum() / v.sum())
    torch.testing.assert_close(out.loss, torch.stack(steps).mean(), rtol=1e-6, atol=1e-6)
    out.loss.backward()
    assert d.lm_head.weight.grad is not None and tiny_target.input_embedding.weight.grad is None


def test_one_loss_for_trainer_and_head():
    import redraft.models.losses as models_losses
    import redraft.train.losses as train_losses

    assert train_losses.drafter_loss is models_losses.drafter_loss
    assert train_losses.IGNORE == models_losses.IGNORE_INDEX == -100


def test_forward_without_labels_stays_a_tensor_and_labels_must_match_tokens(tiny_target):
    d = _head(tiny_target).attach_target(tiny_target)
    ctx, tokens = torch.randn(2, d.config.hidden_size), torch.randint(0, 384, (2, 3))
    assert isinstance(d(ctx, tokens), torch.Tensor)
    out = d(ctx, tokens, return_dict=True)
    assert out.loss is None and torch.equal(out.logits, d(ctx, tokens))
    with pytest.raises(Exception, match="labels have shape"):
        d(ctx, tokens, labels=tokens[:, :2])


class _RecordingHub:
    """HfApi.create_repo / create_commit, recording what would be uploaded (file bytes at commit time)."""

    def __init__(self):
        self.repos, self.files = [], {}

    def create_repo(self, api, repo_id, **kw):
        self.repos.append((repo_id, kw))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, api, repo_id, operations, **kw):
        for op in operations:
            src = op.path_or_fileobj
            self.files[op.path_in_repo] = (
                Path(src).read_bytes() if isinstance(src, (str, os.PathLike)) else src
            )
        return f"https://huggingface.co/{repo_id}/commit/0"


def test_push_to_hub_uploads_a_loadable_head(tiny_target, tmp_path, monkeypatch):
    hub = _RecordingHub()
    monkeypatch.setattr(
        HfApi, "create_repo", lambda api, repo_id, **kw: hub.create_repo(api, repo_id, **kw)
    )
    monkeypatch.setattr(
        HfApi,
        "create_commit",
        lambda api, repo_id, operations, **kw: hub.create_commit(api, repo_id, operations, **kw),
    )

    def no_card(*a, **kw):
        raise EntryNotFoundError("no README.md yet")

    monkeypatch.setattr(ModelCard, "load", no_card)
    d = _head(tiny_target)
    d.push_to_hub("org/head", private=True)
    assert hub.repos == [("org/head", {"private": True, "token": None, "exist_ok": True})]
    assert {"config.json", "model.safetensors", "redraft_head.py", "README.md"} <= set(hub.files)
    for name, data in hub.files.items():
        (tmp_path / name).write_bytes(data)
    assert "weights_sha256" in json.loads(hub.files["config.json"])
    back = load_drafter(tmp_path, tiny_target)  # sha256, fingerprint and every tensor check out
    assert _equal(back, d)
