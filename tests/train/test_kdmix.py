"""``--kd-features`` / ``--kd-data``: KD-only records (cached / read online) mixed into the
training records."""

import numpy as np
import pytest
import torch
from test_features import _cfg  # the same tiny run config

from redraft.errors import ConfigError
from redraft.models.redrafter import ReDrafter, ReDrafterConfig
from redraft.train.batches import TokenRecords
from redraft.train.features import FeatureRecords, cache_features
from redraft.train.fingerprint import target_record
from redraft.train.kdmix import KDOnlyMix
from redraft.train.step import batch_loss
from redraft.train.trainer import train


@pytest.fixture(scope="module")
def cached(tmp_path_factory, tiny_target, tiny_target_dir, chat_file, tiny_data):
    """Features of the tiny chats (float32, k = the vocabulary): used as both sources."""
    path = tmp_path_factory.mktemp("kdmix") / "f"
    cfg = _cfg(path.parent, tiny_target_dir, chat_file)
    cache_features(
        cfg,
        path,
        target=tiny_target,
        dataset=tiny_data[0],
        top_k=tiny_target.vocab_size,
        hidden_dtype="float32",
        progress=False,
    )
    return path


def _loss_of(tmp_path, tiny_target, tiny_target_dir, chat_file, target):
    """``loss(batch, **config overrides)`` of a fixed tiny head (``target``: None when the batch
    carries cached features, else the target that reads it)."""
    torch.manual_seed(0)
    model = ReDrafter(ReDrafterConfig.for_target(tiny_target, num_layers=1, num_steps=3))
    model.attach_target(tiny_target)

    def loss(batch, **over):
        cfg = _cfg(
            tmp_path, tiny_target_dir, chat_file, num_steps=3, draft_vocab_size="none", **over
        )
        return float(batch_loss(model, model, target, batch, cfg, "fp32")[0])

    return loss


def _assert_kd_on_every_token(loss, kd_only, record, contrast: float) -> None:
    """``kd_only`` (a KD-only row of ``record``) under ce+kd / assistant = ``record`` under
    kd / all, and that differs from ``record`` under kd / assistant by more than ``contrast``
    relative."""
    expect = loss(record, loss="kd", kd_positions="all")
    assert loss(kd_only, loss="ce+kd", kd_positions="assistant") == pytest.approx(expect, rel=1e-6)
    assert loss(record, loss="kd", kd_positions="assistant") != pytest.approx(expect, rel=contrast)


def test_kd_only_rows_lose_their_labels_and_learn_kd_on_every_token(
    tmp_path, cached, tiny_target, tiny_target_dir, chat_file
):
    main = FeatureRecords(cached, load_topk=True)
    mix = KDOnlyMix.of_features(main, cached, target_record(tiny_target))
    n = len(main)
    assert len(mix) == 2 * n and mix.lengths[n + 3] == main.lengths[3]
    b = mix.batch(np.array([n + 3, 5]), "cpu")  # a KD-only row and a main row: main first
    one, three = main.batch(np.array([5]), "cpu"), main.batch(np.array([3]), "cpu")
    assert b.kd_rows.tolist() == [False, True]
    assert torch.equal(b.mask[0, : one.mask.shape[1]], one.mask[0])
    assert b.mask[1].sum() == 0 and three.mask.sum() > 0  # no cross-entropy on its labels
    L = int(main.lengths[3])
    assert torch.equal(b.ids[1, :L], three.ids[0]) and (b.ids[1, L:] == 0).all()
    assert torch.equal(b.hidden[1, :L], three.hidden[0])
    assert torch.equal(b.topk_logits[1, :L], three.topk_logits[0])

    # a KD-only row under ce+kd / assistant = that record under kd / all: KD on every token
    loss = _loss_of(tmp_path, tiny_target, tiny_target_dir, chat_file, None)
    _assert_kd_on_every_token(loss, mix.batch(np.array([n + 3]), "cpu"), three, 1e-3)
    # a main row is untouched by the mix
    m = mix.batch(np.array([3]), "cpu")
    assert loss(m, loss="ce+kd") == pytest.approx(loss(three, loss="ce+kd"), rel=1e-6)


def test_a_run_with_kd_features_trains_on_both(
    tmp_path, cached, tiny_target, tiny_target_dir, chat_file, tiny_data
):
    cfg = _cfg(
        tmp_path, tiny_target_dir, chat_file, features=cached, kd_features=cached, loss="ce+kd"
    )
    out = train(cfg, target=tiny_target, eval_dataset=tiny_data[1])
    n = len(FeatureRecords(cached))
    # one epoch over both sources: 2n records, micro batch 2 x accumulation 2
    assert out["features"] and out["global_step"] == 2 * n // 4


def test_kd_features_needs_features_and_a_kd_loss(tmp_path, tiny_target_dir, chat_file):
    with pytest.raises(ConfigError, match="--kd-features .* needs --features"):
        _cfg(tmp_path, tiny_target_dir, chat_file, kd_features="x", loss="ce+kd")
    with pytest.raises(ConfigError, match="--kd-features .* needs --features"):
        _cfg(tmp_path, tiny_target_dir, chat_file, kd_features="x", features="y", loss="ce")


def test_online_kd_only_rows_learn_the_targets_kl_on_every_token(
    tmp_path, tiny_target, tiny_target_dir, chat_file, tiny_data
):
    """``--kd-data``: the same mix over token records; the target reads them in the step."""
    main = TokenRecords(tiny_data[0])
    mix = KDOnlyMix(main, TokenRecords(tiny_data[0]))
    n = len(main)
    b = mix.batch(np.array([n + 3, 5]), "cpu")
    three = main.batch(np.array([3]), "cpu")
    assert b.kd_rows.tolist() == [False, True] and b.hidden is None
    assert b.mask[1].sum() == 0 and three.mask.sum() > 0
    # the same as from the cache, the teacher now the target's LM head (its random KL differs
    # little from place to place: 2.5e-4 relative between assistant and every token here)
    loss = _loss_of(tmp_path, tiny_target, tiny_target_dir, chat_file, tiny_target)
    _assert_kd_on_every_token(loss, mix.batch(np.array([n + 3]), "cpu"), three, 2e-5)


def test_a_run_with_kd_data_trains_online_on_both(
    tmp_path, tiny_target, tiny_target_dir, chat_file, tiny_data, capsys
):
    cfg = _cfg(
        tmp_path,
        tiny_target_dir,
        chat_file,
        kd_data=f"sharegpt:{chat_file}",
        kd_limit=8,
        loss="ce+kd",
    )
    out = train(cfg, target=tiny_target, train_dataset=tiny_data[0], eval_dataset=tiny_data[1])
    said = capsys.readouterr()
    n = len(tiny_data[0])
    assert n > 8 and "+ 8 KD-only records" in said.out + said.err
    # one epoch over both sources: n + 8 records, micro batch 2 x accumulation 2
    assert not out["features"] and out["global_step"] == (n + 8) // 4


def test_kd_data_needs_a_kd_loss_and_no_features(tmp_path, tiny_target_dir, chat_file):
    with pytest.raises(ConfigError, match="--kd-data x trains online .*pass them as --kd-features"):
        _cfg(tmp_path, tiny_target_dir, chat_file, kd_data="x", features="y", loss="ce+kd")
    with pytest.raises(ConfigError, match="--kd-data x trains online"):
        _cfg(tmp_path, tiny_target_dir, chat_file, kd_data="x", loss="ce")
