"""Export to and import from Apple's ml-recurrent-drafter layout (redraft-export, load_drafter)."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from redraft.errors import ArtifactError, ConfigError
from redraft.infer.drafters.redrafter.drafter import beam_search
from redraft.models import apple
from redraft.models.drafter_io import load_drafter, read_drafter
from redraft.models.redrafter import ReDrafter, ReDrafterConfig
from redraft.train.export import export_head, main


def _head(target, seed=0, **kw):
    torch.manual_seed(seed)
    d = ReDrafter(ReDrafterConfig.for_target(target, num_steps=4, **kw)).attach_target(target)
    with (
        torch.no_grad()
    ):  # larger than the 0.02 init, so a wrong permutation changes the logits a lot
        for p in d.parameters():
            p.normal_(0, 0.3)
    return d


def _saved(target, path, **kw):
    d = _head(target, **kw)
    d.save_pretrained(path)
    return d


def apple_reference_logits(tensors, cfg, context, tokens, embedding):
    """Apple's Drafter, written from its modeling_drafter.py with the exported tensors only:
    s_i = silu(rnn_w e_i + rnn_u s_{i-1}) (s_{-1} = 0), h = cat([context, s]), ResBlocks, Linear."""
    H, L = cfg["hidden_size"], cfg["num_draft_layers"]
    s = torch.zeros(*tokens.shape[:-1], H)
    out = []
    for i in range(tokens.shape[-1]):
        e = embedding[tokens[..., i]]
        if cfg["rnn"]:
            s = F.silu(
                e @ tensors["rnn_w.weight"].T
                + s @ tensors["rnn_u.weight"].T
                + tensors["rnn_u.bias"]
            )
        else:
            s = s + e
        h = torch.cat([context, s], dim=-1)  # context first
        for j in range(L):
            h = h + F.silu(
                h @ tensors[f"lm_head.{j}.linear.weight"].T + tensors[f"lm_head.{j}.linear.bias"]
            )
        out.append(h @ tensors[f"lm_head.{L}.weight"].T)
    return torch.stack(out, dim=-2)


def test_apple_layout_has_exactly_the_names_and_shapes_apple_reads(tiny_target, tmp_path):
    d = _saved(tiny_target, tmp_path / "head", num_layers=3)
    out = export_head(tmp_path / "head", tmp_path / "apple")
    cfg = json.loads((out / "config.json").read_text())
    H, V = d.config.hidden_size, d.config.vocab_size
    assert cfg["model_type"] == "recurrent_drafting_drafter"
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["exit_dim"]) == (V, H, 2 * H)
    assert cfg["num_draft_layers"] == 3 and cfg["rnn"] is True and cfg["num_lookback_tokens"] == 1
    shapes = {k: tuple(v.shape) for k, v in load_file(str(out / "model.safetensors")).items()}
    expect = {
        "rnn_u.weight": (H, H),
        "rnn_u.bias": (H,),
        "rnn_w.weight": (H, H),
        "lm_head.3.weight": (V, 2 * H),
    }
    expect.update(
        {
            f"lm_head.{i}.linear.{w}": (2 * H, 2 * H) if w == "weight" else (2 * H,)
            for i in range(3)
            for w in ("weight", "bias")
        }
    )
    assert shapes == expect  # no bias on the output layer, full target vocabulary


@pytest.mark.parametrize("rnn", [True, False])
def test_exported_tensors_compute_the_same_logits_in_apples_forward(tiny_target, tmp_path, rnn):
    d = _saved(tiny_target, tmp_path / "head", rnn=rnn)
    out = export_head(tmp_path / "head", tmp_path / "apple")
    tensors = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    ctx = torch.randn(3, d.config.hidden_size)
    tokens = torch.randint(0, d.config.vocab_size, (3, 4))
    ref = apple_reference_logits(tensors, cfg, ctx, tokens, tiny_target.input_embedding.weight)
    torch.testing.assert_close(ref, d(ctx, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rnn", [True, False])
def test_round_trip_redraft_apple_redraft_is_exact(tiny_target, tmp_path, rnn):
    d = _saved(
        tiny_target,
        tmp_path / "head",
        rnn=rnn,
        num_layers=2,
        target_weights_fingerprint="sha256:0123abcd",
    )
    export_head(tmp_path / "head", tmp_path / "apple")
    back = load_drafter(tmp_path / "apple", tiny_target)  # detected from model_type
    a, b = d.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for key in (
        "num_steps",
        "num_layers",
        "rnn",
        "activation",
        "target_model",
        "tokenizer_fingerprint",
        "target_weights_fingerprint",
        "vocab_size",
        "hidden_size",
        "embedding_dim",
        "draft_vocab_size",
    ):
        assert getattr(back.config, key) == getattr(d.config, key), key
    ctx = torch.randn(2, d.config.hidden_size)
    tokens = torch.randint(0, d.config.vocab_size, (2, 4))
    assert torch.equal(back(ctx, tokens), d(ctx, tokens))
    last = torch.tensor([5, 77])
    t1, lp1, s1 = beam_search(d, ctx, last, width=4, length=4)
    t2, lp2, s2 = beam_search(back, ctx, last, width=4, length=4)
    assert torch.equal(t1, t2) and torch.equal(lp1, lp2) and torch.equal(s1, s2)


def test_export_keeps_or_casts_the_dtype(tiny_target, tmp_path):
    _saved(tiny_target, tmp_path / "head")
    out = export_head(tmp_path / "head", tmp_path / "bf16", dtype="bfloat16")
    assert {v.dtype for v in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    out = export_head(tmp_path / "head", tmp_path / "keep")
    assert {v.dtype for v in load_file(str(out / "model.safetensors")).values()} == {torch.float32}


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"draft_vocab_size": 64}, "full vocabulary"),
        ({"activation": "gelu"}, "--activation silu"),
    ],
)
def test_export_refuses_what_the_layout_cannot_express(tiny_target, tmp_path, capsys, kw, says):
    d = _saved(tiny_target, tmp_path / "head", **kw)
    if "draft_vocab_size" in kw:
        d.set_draft_vocab(torch.arange(64))
        d.save_pretrained(tmp_path / "head")
    capsys.readouterr()
    assert main([str(tmp_path / "head"), str(tmp_path / "apple")]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "apple").exists()


def test_export_refuses_a_multi_layer_head_in_one_line(tiny_target, tmp_path, capsys):
    _saved(tiny_target, tmp_path / "head", features="multi")
    capsys.readouterr()
    assert main([str(tmp_path / "head"), str(tmp_path / "apple")]) == 2
    err = capsys.readouterr().err
    assert "a multi-layer head has no Apple or TensorRT-LLM equivalent" in err
    assert "--head-features last" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "apple").exists()


def test_export_refuses_embedding_dim_other_than_hidden_size(tmp_path):
    ReDrafter(ReDrafterConfig(hidden_size=16, embedding_dim=8, vocab_size=50)).save_pretrained(
        tmp_path / "head"
    )
    with pytest.raises(ConfigError, match="embedding_dim"):
        export_head(tmp_path / "head", tmp_path / "apple")


def test_cli_prints_the_tensorrt_llm_commands(tiny_target, tmp_path, capsys):
    _saved(tiny_target, tmp_path / "head")
    out = tmp_path / "apple"
    assert main([str(tmp_path / "head"), str(out)]) == 0
    text = capsys.readouterr().out
    assert f"--drafter_model_dir {out}" in text
    # TensorRT-LLM's ReDrafter converter takes the target as a converted checkpoint, made first
    base = f"{out}-tllm-base-ckpt"
    assert f"convert_checkpoint.py --model_dir {tiny_target.model_id} --output_dir {base}" in text
    assert f"--base_model_checkpoint_dir {base} --drafter_model_dir {out}" in text
    assert text.index(f"--output_dir {base}") < text.index("--base_model_checkpoint_dir")
    assert "--redrafter_draft_len_per_beam 4" in text and "<= 4" in text  # num_steps of the head
    assert "trtllm-build" in text and "--speculative_decoding_mode explicit_draft_tokens" in text
    assert "rnn_embed" in text  # the warning about TensorRT-LLM's own recurrence


def test_cli_checks_the_output_before_any_work(tiny_target, tmp_path, capsys):
    _saved(tiny_target, tmp_path / "head")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    (tmp_path / "file").write_text("x")
    capsys.readouterr()
    for out, says in [("busy", "--overwrite"), ("file", "is a file"), ("head", "HEAD_DIR itself")]:
        assert main([str(tmp_path / "head"), str(tmp_path / out)]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1
    assert main([str(tmp_path / "missing"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([str(tmp_path / "head"), str(tmp_path / "busy"), "--overwrite"]) == 0
    assert (tmp_path / "busy" / "model.safetensors").is_file() and (
        tmp_path / "busy" / "keep.txt"
    ).is_file()


def _apple_native(tmp_path, H=32, V=384, L=2, rnn=True, drop=None, config_over=None):
    """A head as Apple's own trainer writes it: no redraft entry, no recorded sha256."""
    torch.manual_seed(1)
    tensors = {}
    if rnn:
        tensors.update(
            {
                "rnn_u.weight": torch.randn(H, H) * 0.3,
                "rnn_u.bias": torch.randn(H) * 0.3,
                "rnn_w.weight": torch.randn(H, H) * 0.3,
            }
        )
    for i in range(L):
        tensors[f"lm_head.{i}.linear.weight"] = torch.randn(2 * H, 2 * H) * 0.3
        tensors[f"lm_head.{i}.linear.bias"] = torch.randn(2 * H) * 0.3
    tensors[f"lm_head.{L}.weight"] = torch.randn(V, 2 * H) * 0.3
    if drop:
        tensors.pop(drop)
    cfg = {
        "model_type": "recurrent_drafting_drafter",
        "vocab_size": V,
        "hidden_size": H,
        "exit_dim": 2 * H,
        "num_draft_layers": L,
        "num_lookback_tokens": -1,
        "rnn": rnn,
        **(config_over or {}),
    }
    path = tmp_path / "apple-native"
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    return path, tensors, cfg


def test_head_trained_with_apples_code_loads_with_warnings_and_computes_apples_forward(
    tiny_target, tmp_path
):
    path, tensors, cfg = _apple_native(tmp_path)
    with pytest.warns(UserWarning) as record:
        d = load_drafter(path, tiny_target)
    said = " ".join(str(w.message) for w in record)
    assert "tokenizer fingerprint" in said and "weights_sha256" in said
    assert d.config.num_layers == 2 and d.config.tokenizer_fingerprint is None
    ctx, tokens = torch.randn(2, 32), torch.randint(0, 384, (2, 3))
    ref = apple_reference_logits(tensors, cfg, ctx, tokens, tiny_target.input_embedding.weight)
    torch.testing.assert_close(d(ctx, tokens), ref, rtol=1e-5, atol=1e-5)


def test_apple_layout_is_checked_exactly(tiny_target, tmp_path):
    path, _, _ = _apple_native(tmp_path, drop="lm_head.1.linear.bias")
    with pytest.raises(ArtifactError, match=r"missing tensors lm_head\.1\.linear\.bias"):
        read_drafter(path)


@pytest.mark.parametrize(
    "over, key",
    [
        ({"exit_dim": 48}, "exit_dim"),
        ({"num_draft_layers": "2"}, "num_draft_layers"),
        ({"rnn": 1}, "rnn"),
        ({"vocab_size": 100}, "vocab_size"),
    ],
)
def test_apple_config_values_are_checked(tiny_target, tmp_path, over, key):
    path, _, _ = _apple_native(tmp_path, config_over=over)
    with pytest.raises(ArtifactError, match=key):
        load_drafter(path, tiny_target)


def test_changed_exported_weights_are_detected(tiny_target, tmp_path):
    _saved(tiny_target, tmp_path / "head")
    out = export_head(tmp_path / "head", tmp_path / "apple")
    t = load_file(str(out / "model.safetensors"))
    t["rnn_u.bias"] = t["rnn_u.bias"] + 1
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ArtifactError, match="sha256"):
        load_drafter(out, tiny_target)


def test_init_from_an_apple_layout_head_starts_training_from_its_weights(tiny_target, tmp_path):
    """redraft-train --init-from reads Apple's layout (through load_drafter): with a negligible
    learning rate, one step leaves the weights where the Apple head had them."""
    from redraft.data import build_token_dataset
    from redraft.train.config import make_config
    from redraft.train.trainer import train

    chats = tmp_path / "chat.jsonl"
    with open(chats, "w") as f:
        for i in range(24):
            conv = [
                {"from": "human", "value": f"say {i}"},
                {"from": "gpt", "value": " ".join(["one two three"] * 3)},
            ]
            f.write(json.dumps({"id": f"c{i}", "conversations": conv}) + "\n")
    kw = dict(max_length=64, num_proc=1, cache_dir=tmp_path / "cache", progress=False)
    data = [
        build_token_dataset(f"sharegpt:{chats}", tiny_target.tokenizer, split=s, **kw)
        for s in ("train", "heldout")
    ]
    d = _saved(tiny_target, tmp_path / "head")
    export_head(tmp_path / "head", tmp_path / "apple")
    cfg = make_config(
        "tiny",
        {
            "output_dir": str(tmp_path / "run"),
            "tensorboard": "false",
            "max_steps": "1",
            "lr": "1e-12",
            "num_steps": "4",
            "num_layers": "2",
            "init_from": str(tmp_path / "apple"),
        },
    )
    assert cfg.num_layers == d.config.num_layers
    train(cfg, target=tiny_target, train_dataset=data[0], eval_dataset=data[1])
    tuned = load_file(str(tmp_path / "run" / "model.safetensors"))
    for k, v in d.state_dict().items():
        torch.testing.assert_close(tuned[k], v, rtol=0, atol=1e-6)


def test_swap_halves_is_its_own_inverse_for_equal_halves():
    perm = apple.swap_halves(3, 3)
    assert perm.tolist() == [3, 4, 5, 0, 1, 2] and torch.equal(perm[perm], torch.arange(6))
    assert apple.swap_halves(2, 3).tolist() == [2, 3, 4, 0, 1]
