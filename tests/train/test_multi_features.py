"""features: multi (EAGLE-3 style): a head that reads a low, a middle and the last layer's hidden
states, end to end: config checks, training, the artifact, feature caches, and decoding (the
verify forward hands the same features to the drafter that training used)."""

import pytest
import torch

from redraft.errors import ConfigError, RedraftError
from redraft.infer.decoder import SpeculativeDecoder, lower_hidden_layers, plain_greedy
from redraft.infer.drafters.redrafter.drafter import ReDrafterDrafter
from redraft.models import load_target
from redraft.models.drafter_io import load_drafter
from redraft.models.redrafter import ReDrafter, ReDrafterConfig
from redraft.models.redrafter_config import default_feature_layers
from redraft.testing import make_tiny_target_dir
from redraft.train.config import make_config
from redraft.train.step import target_hidden
from redraft.train.trainer import train


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    """A tiny target with 4 layers (the shared one has 2): multi reads layers 1, 2 and 4."""
    d = make_tiny_target_dir(tmp_path_factory.mktemp("tiny-4layers"), num_layers=4)
    return load_target(str(d), dtype="float32", device="cpu")


def test_default_layers_are_a_quarter_a_half_and_the_last():
    assert default_feature_layers(30) == [7, 15, 30]
    assert default_feature_layers(4) == [1, 2, 4]
    assert default_feature_layers(2) == [1, 2]


def test_a_multi_config_records_the_layers_and_old_configs_read_as_last(deep_target):
    c = ReDrafterConfig.for_target(deep_target, features="multi")
    assert (c.feature_layers, c.target_num_layers, c.feature_size) == ([1, 2, 4], 4, 3 * 32)
    old = ReDrafterConfig.for_target(deep_target).to_dict()
    for k in ("features", "feature_layers", "target_num_layers"):
        old.pop(k)
    last = ReDrafterConfig.from_dict(old)  # a config.json written before the field existed
    assert last.features == "last" and last.hidden_layers == () and last.feature_size == 32


@pytest.mark.parametrize(
    "layers", [[1, 2], [2, 1, 4], [0, 2, 4], [4], [1, 1, 4], [1, 2, 5], [1.0, 4]]
)
def test_bad_layer_indices_are_a_clear_error(deep_target, layers):
    with pytest.raises(ConfigError, match=r"feature_layers=.*target_num_layers=4.*ending with 4"):
        ReDrafterConfig.for_target(deep_target, features="multi", feature_layers=layers)


def test_layers_without_multi_and_unknown_features_are_errors(deep_target):
    with pytest.raises(ConfigError, match="needs features='multi'"):
        ReDrafterConfig.for_target(deep_target, feature_layers=[1, 4])
    with pytest.raises(ConfigError, match="features='all' must be one of last, multi"):
        ReDrafterConfig.for_target(deep_target, features="all")
    with pytest.raises(ConfigError, match="--feature-layers .* needs --head-features multi"):
        make_config("tiny", {"feature_layers": "1,4"})


def test_an_untrained_multi_head_is_the_last_head(deep_target):
    torch.manual_seed(0)
    multi = ReDrafter(ReDrafterConfig.for_target(deep_target, features="multi"))
    last = ReDrafter(ReDrafterConfig.for_target(deep_target))
    last.load_state_dict(
        {k: v for k, v in multi.state_dict().items() if k != "feature_proj.weight"}
    )
    multi.attach_target(deep_target), last.attach_target(deep_target)
    ids = torch.randint(0, 300, (2, 9))
    feats = target_hidden(deep_target, ids, "fp32", multi.config.hidden_layers)  # [2, 9, 96]
    final = deep_target.model.base_model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(feats[..., -32:], final)
    torch.testing.assert_close(multi(feats[:, 3], ids[:, 4:7]), last(final[:, 3], ids[:, 4:7]))
    # the lower layers' states do reach the output once the projection has learned something
    with torch.no_grad():
        multi.feature_proj.weight[:, :32].normal_()
    assert not torch.allclose(multi(feats[:, 3], ids[:, 4:7]), last(final[:, 3], ids[:, 4:7]))


def test_a_head_for_another_layer_count_is_refused(deep_target, tiny_target):
    head = ReDrafter(ReDrafterConfig.for_target(deep_target, features="multi"))
    with pytest.raises(RedraftError, match=r"layers \[1, 2, 4\] of a 4-layer target.*has 2"):
        head.attach_target(tiny_target)


def _multi_cfg(tmp_path, name="multi", **over):
    base = {
        "output_dir": str(tmp_path / name),
        "report_to": "none",
        "head_features": "multi",
        "max_steps": "4",
    }
    base.update({k: str(v) for k, v in over.items()})
    return make_config("tiny", base)


def test_a_multi_head_trains_saves_loads_and_decodes_like_plain_greedy(
    tmp_path, deep_target, tiny_data
):
    cfg = _multi_cfg(tmp_path, loss="ce+kd", draft_vocab_size=64)
    m = train(cfg, target=deep_target, train_dataset=tiny_data[0], eval_dataset=tiny_data[1])
    assert m["status"] == "completed" and m["eval_tau_est"] >= 1.0
    head = load_drafter(cfg.output_dir, deep_target)
    assert head.config.features == "multi" and head.config.feature_layers == [1, 2, 4]
    assert head.feature_proj.weight.shape == (32, 96)
    # the projection trained: its lower layers' columns left zero
    assert head.feature_proj.weight[:, :64].abs().sum() > 0

    drafter = ReDrafterDrafter(head, width=4, length=3)
    assert drafter.hidden_layers == (1, 2, 4)
    prompts = ["count from three", "The quick brown fox jumps over the lazy dog. The quick"]
    ref = plain_greedy(deep_target, prompts, max_new_tokens=24)
    dec = SpeculativeDecoder(deep_target, [drafter], budget=12)
    assert dec.verifier.hidden_layers == (1, 2)
    out = dec.generate(prompts, max_new_tokens=24)
    assert [o.tokens for o in out] == [r.tokens for r in ref]


class _Spy(ReDrafterDrafter):
    """Records what the drafter got each step: the row's tokens and ``state.hidden``."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []

    def propose(self, state):
        for b in range(state.batch_size):
            n = int(state.lengths[b])
            self.seen.append((state.tokens[b, :n].tolist(), state.hidden[b].clone()))
        return super().propose(state)


def test_decoding_gives_the_drafter_the_features_training_uses(deep_target):
    """At every step (after prefill and after each verify, accepted paths of any length), the
    drafter's ``state.hidden`` is the training features of the sequence at the position that
    produced the bonus token: the pairing the head was trained on."""
    torch.manual_seed(1)
    head = ReDrafter(ReDrafterConfig.for_target(deep_target, features="multi"))
    spy = _Spy(head.attach_target(deep_target), width=4, length=3)
    dec = SpeculativeDecoder(deep_target, [spy], budget=12)
    dec.generate(["hello there, count from one", "def add(a, b):"], max_new_tokens=12)
    assert len(spy.seen) > 4
    for toks, hid in spy.seen:
        feats = target_hidden(deep_target, torch.tensor([toks[:-1]]), "fp32", (1, 2, 4))
        assert hid.shape == (96,)
        torch.testing.assert_close(hid, feats[0, -1], atol=2e-4, rtol=1e-4)


def test_last_heads_change_nothing_and_different_layer_sets_are_refused(deep_target):
    last = ReDrafterDrafter(
        ReDrafter(ReDrafterConfig.for_target(deep_target)).attach_target(deep_target)
    )
    assert last.hidden_layers == () and lower_hidden_layers([last]) == ()
    assert SpeculativeDecoder(deep_target, [last]).verifier.hidden_layers == ()

    def multi(layers, name):
        cfg = ReDrafterConfig.for_target(deep_target, features="multi", feature_layers=layers)
        return ReDrafterDrafter(ReDrafter(cfg).attach_target(deep_target), name=name)

    assert lower_hidden_layers([last, multi([1, 2, 4], "a")]) == (1, 2)
    with pytest.raises(ConfigError, match="different layer sets"):
        SpeculativeDecoder(deep_target, [multi([1, 2, 4], "a"), multi([2, 4], "b")])


def test_a_last_head_beside_a_multi_head_reads_the_last_columns(deep_target):
    """A mix of a last head and a multi head: greedy output is still plain greedy's."""
    torch.manual_seed(2)
    last = ReDrafter(ReDrafterConfig.for_target(deep_target)).attach_target(deep_target)
    multi = ReDrafter(ReDrafterConfig.for_target(deep_target, features="multi"))
    multi.attach_target(deep_target)
    drafters = [ReDrafterDrafter(last, name="last"), ReDrafterDrafter(multi, name="multi")]
    x = torch.randn(2, 96)
    torch.testing.assert_close(drafters[0].context(x), x[:, -32:])
    prompts = ["count from five", "hello"]
    ref = plain_greedy(deep_target, prompts, max_new_tokens=16)
    out = SpeculativeDecoder(deep_target, drafters, budget=12).generate(prompts, max_new_tokens=16)
    assert [o.tokens for o in out] == [r.tokens for r in ref]


def test_cached_multi_features_train_and_a_mismatched_cache_is_refused(
    tmp_path, deep_target, tiny_data
):
    from redraft.train.features import FeatureRecords, cache_features

    cfg = _multi_cfg(tmp_path, loss="ce+kd")
    feats = tmp_path / "feats"
    meta = cache_features(
        cfg, feats, target=deep_target, dataset=tiny_data[0], hidden_dtype="float32", progress=False
    )
    assert meta["hidden_layers"] == [1, 2, 4]
    rec = FeatureRecords(feats, load_topk=True)
    b = rec.batch([0], "cpu")
    want = target_hidden(deep_target, b.ids, "fp32", (1, 2, 4))
    torch.testing.assert_close(b.hidden, want, atol=1e-5, rtol=1e-5)

    run = _multi_cfg(tmp_path, name="from-features", loss="ce+kd", features=feats)
    m = train(run, target=deep_target, eval_dataset=tiny_data[1])
    assert m["status"] == "completed"
    last = make_config(
        "tiny", {"output_dir": str(tmp_path / "last"), "report_to": "none", "features": str(feats)}
    )
    with pytest.raises(ConfigError, match=r"layers \[1, 2, 4\], but this head .* reads last"):
        train(last, target=deep_target, eval_dataset=tiny_data[1])
