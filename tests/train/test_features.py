"""Cached target features: what a shard holds, training from it, KD from top-k, damage and resume."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from redraft.errors import ArtifactError, ConfigError, FingerprintMismatchError
from redraft.models.redrafter import ReDrafter, ReDrafterConfig
from redraft.train import features as feat
from redraft.train.config import make_config
from redraft.train.features import FeatureRecords, cache_features
from redraft.train.fingerprint import target_record
from redraft.train.losses import drafter_loss
from redraft.train.step import target_hidden, target_topk, topk_teacher_logprobs
from redraft.train.trainer import train


def _cfg(tmp_path, tiny_target_dir, chat_file, name="run", **over):
    base = {
        "output_dir": str(tmp_path / name),
        "report_to": "none",
        "target": str(tiny_target_dir),
        "data": f"sharegpt:{chat_file}",
    }
    base.update({k: str(v) for k, v in over.items()})
    return make_config("tiny", base)


def _assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _cache(cfg, path, tiny_target, tiny_data, **kw):
    kw.setdefault("progress", False)
    return cache_features(cfg, path, target=tiny_target, dataset=tiny_data[0], **kw)


def test_shards_hold_the_records_hidden_states_and_top_k(
    tmp_path, tiny_target, tiny_target_dir, chat_file, tiny_data
):
    cfg = _cfg(tmp_path, tiny_target_dir, chat_file)
    meta = _cache(cfg, tmp_path / "f", tiny_target, tiny_data, top_k=4, shard_mb=0.05)
    assert (
        meta["complete"] and len(meta["shards"]) > 2
    )  # small shards: records spread over several files
    assert meta["records"] == len(tiny_data[0]) and meta["target"][
        "weights_fingerprint"
    ].startswith("sha256:")
    per_token = 32 * 2 + 4 * 8 + 4 + 1  # bf16 hidden [32], top-4 ids+logits, id, mask
    assert meta["bytes_per_token"] == per_token
    assert feat.disk_bytes(tmp_path / "f") == pytest.approx(per_token * meta["tokens"], rel=0.05)

    rec = FeatureRecords(tmp_path / "f", load_topk=True)
    idx = np.array([len(rec) - 1, 0, 57])  # records from the last, first and a middle shard
    b = rec.batch(idx, "cpu")
    rows = tiny_data[0][idx.tolist()]
    for i, (ids, mask) in enumerate(zip(rows["input_ids"], rows["loss_mask"])):
        n = len(ids)
        assert b.ids[i, :n].tolist() == ids and b.mask[i, :n].tolist() == mask
        assert (b.ids[i, n:] == 0).all() and (b.mask[i, n:] == 0).all()
        online = target_hidden(tiny_target, torch.tensor([ids]), "fp32")[0]  # [n, H]
        assert b.hidden.dtype == torch.bfloat16
        torch.testing.assert_close(
            b.hidden[i, :n].float(), online, rtol=2**-8, atol=1e-6
        )  # bf16 rounding
        top_ids, top_val = target_topk(tiny_target, online, "fp32", 4)
        assert torch.equal(b.topk_ids[i, :n], top_ids)
        torch.testing.assert_close(b.topk_logits[i, :n], top_val)
    assert b.tokens == sum(len(r) for r in rows["input_ids"])
    assert b.loss_tokens == sum(sum(m[2:]) for m in rows["loss_mask"])


@pytest.mark.parametrize("loss", ["ce+kd"])
def test_a_run_from_cached_features_equals_the_online_run(
    tmp_path, tiny_target, tiny_target_dir, chat_file, tiny_data, loss
):
    """float32 features with k = the whole vocabulary, online KD over the whole vocabulary too
    (kd_top_k): the same hidden states and the same KD teacher, so the same weights as a run whose
    target runs every step (up to matmul rounding)."""
    over = dict(max_steps=6, lr=0.01, loss=loss, kd_top_k=tiny_target.vocab_size)
    online = train(
        _cfg(tmp_path, tiny_target_dir, chat_file, "online", **over),
        target=tiny_target,
        train_dataset=tiny_data[0],
        eval_dataset=tiny_data[1],
    )
    cfg = _cfg(tmp_path, tiny_target_dir, chat_file, "cached", features=tmp_path / "f", **over)
    _cache(
        cfg,
        tmp_path / "f",
        tiny_target,
        tiny_data,
        top_k=tiny_target.vocab_size,
        hidden_dtype="float32",
    )
    cached = train(cfg, target=tiny_target, eval_dataset=tiny_data[1])
    assert cached["features"] and not online["features"] and cached["global_step"] == 6
    a, b = (
        load_file(str(tmp_path / "online" / "model.safetensors")),
        load_file(str(tmp_path / "cached" / "model.safetensors")),
    )
    torch.manual_seed(0)  # the trainer's init (seed 0): training moved the weights far from it
    init = ReDrafter(
        ReDrafterConfig.for_target(tiny_target, num_layers=1, num_steps=3)
    ).state_dict()
    assert (a["lm_head.weight"] - init["lm_head.weight"]).abs().max() > 1e-2
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5)
    assert cached["eval_loss"] == pytest.approx(online["eval_loss"], rel=1e-6)


def test_kd_from_top_k_logits_equals_kd_from_full_logits_when_k_covers_the_distribution():
    torch.manual_seed(0)
    P, n, V, k = 6, 3, 40, 5
    cfg = ReDrafterConfig(hidden_size=8, vocab_size=V)
    model = ReDrafter(cfg)
    logits = torch.randn(P, n, V)
    valid = torch.rand(P, n) > 0.2
    # a teacher whose mass lies on k tokens per position (every other logit ~ -inf)
    support = torch.rand(P, n, V).argsort(-1)[..., :k]
    teacher = torch.full((P, n, V), -1e4).scatter(-1, support, torch.randn(P, n, k) * 3)
    top = teacher.topk(k, -1)
    full_kd, _ = drafter_loss(
        logits, support[..., 0], valid, teacher.log_softmax(-1), ce_weight=0, kd_weight=1
    )
    topk_kd, _ = drafter_loss(
        logits,
        support[..., 0],
        valid,
        topk_teacher_logprobs(model, top.indices.int(), top.values),
        ce_weight=0,
        kd_weight=1,
    )
    torch.testing.assert_close(topk_kd, full_kd)
    assert float(full_kd) > 0.5
    # fewer than the support: the teacher is renormalised over k-2 tokens, a different loss
    top2 = teacher.topk(k - 2, -1)
    fewer, _ = drafter_loss(
        logits,
        support[..., 0],
        valid,
        topk_teacher_logprobs(model, top2.indices.int(), top2.values),
        ce_weight=0,
        kd_weight=1,
    )
    assert abs(float(fewer) - float(full_kd)) > 1e-3

    # a reduced draft vocabulary: the online teacher is the softmax over the draft ids; top-k ids
    # outside it are dropped and the rest renormalised, which is the same distribution
    reduced = ReDrafter(ReDrafterConfig(hidden_size=8, vocab_size=V, draft_vocab_size=20))
    keep = torch.randperm(V)[:20]
    reduced.set_draft_vocab(keep)
    online = teacher[..., reduced.draft_to_target].log_softmax(
        -1
    )  # what step.full_teacher_logprobs does
    dense = topk_teacher_logprobs(reduced, top.indices.int(), top.values)
    rows = torch.isin(support, keep).any(
        -1
    )  # positions with some teacher mass inside the draft vocabulary
    torch.testing.assert_close(dense.exp()[rows], online.exp()[rows], atol=1e-6, rtol=0)
    d_logits = torch.randn(P, n, 20)
    a, _ = drafter_loss(
        d_logits, support[..., 0] * 0, valid & rows, online, ce_weight=0, kd_weight=1
    )
    b, _ = drafter_loss(
        d_logits, support[..., 0] * 0, valid & rows, dense, ce_weight=0, kd_weight=1
    )
    torch.testing.assert_close(a, b)
    assert torch.isfinite(dense).all()  # positions with nothing inside give zero loss, never NaN


def test_a_truncated_shard_is_named_and_a_new_cache_run_rewrites_it(
    tmp_path, tiny_target, tiny_target_dir, chat_file, tiny_data
):
    cfg = _cfg(tmp_path, tiny_target_dir, chat_file)
    meta = _cache(cfg, tmp_path / "f", tiny_target, tiny_data, shard_mb=0.05)
    victim = tmp_path / "f" / meta["shards"][1]["file"]
    good = victim.read_bytes()
    before = {k: v.clone() for k, v in load_file(str(victim)).items()}  # load_file maps the file
    victim.write_bytes(good[: len(good) - 100])
    with pytest.raises(ArtifactError, match="truncated") as exc:
        FeatureRecords(tmp_path / "f")
    assert str(victim) in str(exc.value)
    victim.write_bytes(good[:5])  # not even a header
    with pytest.raises(ArtifactError) as exc:
        FeatureRecords(tmp_path / "f")
    assert str(victim) in str(exc.value)
    _cache(cfg, tmp_path / "f", tiny_target, tiny_data, shard_mb=0.05)  # the same arguments again
    _assert_same_tensors(load_file(str(victim)), before)
    assert len(FeatureRecords(tmp_path / "f")) == len(tiny_data[0])


def test_a_killed_cache_run_keeps_its_shards_and_continues(
    tmp_path, tiny_target, tiny_target_dir, chat_file, tiny_data, monkeypatch
):
    cfg = _cfg(tmp_path, tiny_target_dir, chat_file)
    straight = _cache(cfg, tmp_path / "straight", tiny_target, tiny_data, shard_mb=0.05)

    written = []
    real_write = feat.writer._write_shard

    class Killed(BaseException):
        pass

    def write_then_die(path, tensors, metadata):
        if len(written) == 2:
            raise Killed  # like a SIGKILL: no clean-up code runs
        written.append(path.name)
        real_write(path, tensors, metadata)

    monkeypatch.setattr(feat.writer, "_write_shard", write_then_die)
    with pytest.raises(Killed):
        _cache(cfg, tmp_path / "f", tiny_target, tiny_data, shard_mb=0.05)
    assert not json.loads((tmp_path / "f" / "features.json").read_text())["complete"]
    with pytest.raises(ConfigError, match="unfinished.*2 of"):
        FeatureRecords(tmp_path / "f")

    monkeypatch.setattr(
        feat.writer, "_write_shard", lambda p, t, m: (written.append(p.name), real_write(p, t, m))
    )
    meta = _cache(cfg, tmp_path / "f", tiny_target, tiny_data, shard_mb=0.05)
    assert meta["complete"]
    assert written[2:] == [
        s["file"] for s in meta["shards"][2:]
    ]  # only the missing shards were computed
    for s in straight["shards"]:
        _assert_same_tensors(
            load_file(str(tmp_path / "f" / s["file"])),
            load_file(str(tmp_path / "straight" / s["file"])),
        )
    with pytest.raises(
        ConfigError, match="other settings.*top_k"
    ):  # another setting is not a resume
        _cache(cfg, tmp_path / "f", tiny_target, tiny_data, shard_mb=0.05, top_k=3)


def test_features_must_match_the_runs_data_and_target(
    tmp_path, tiny_target, tiny_target_dir, chat_file, tiny_data, other_target
):
    cfg = _cfg(tmp_path, tiny_target_dir, chat_file)
    _cache(cfg, tmp_path / "f", tiny_target, tiny_data)
    longer = _cfg(tmp_path, tiny_target_dir, chat_file, features=tmp_path / "f", max_length=256)
    with pytest.raises(ConfigError, match=r"max_length \(features 128, this run 256\)"):
        train(longer, target=tiny_target, eval_dataset=tiny_data[1])
    other = _cfg(tmp_path, tiny_target_dir, chat_file, "other", features=tmp_path / "f")
    with pytest.raises(FingerprintMismatchError) as exc:
        train(other, target=other_target, eval_dataset=tiny_data[1])
    from redraft.train.fingerprint import weights_fingerprint

    for model in (tiny_target.model, other_target.model):  # both fingerprints named
        assert weights_fingerprint(model) in str(exc.value)
    missing = _cfg(tmp_path, tiny_target_dir, chat_file, "missing", features=tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="redraft-cache-features"):
        train(missing, target=tiny_target)
    assert not Path(missing.output_dir).exists()  # refused before any work


def test_the_cache_features_command_writes_what_train_reads(
    tmp_path, tiny_target, tiny_target_dir, chat_file, capsys
):
    from redraft.train.cli import cache_features_main

    argv = [
        "--recipe",
        "tiny",
        "--target",
        str(tiny_target_dir),
        "--data",
        f"sharegpt:{chat_file}",
        "--num-proc",
        "1",
        "--data-cache-dir",
        str(tmp_path / "cache"),
        "--output-dir",
        str(tmp_path / "f"),
        "--top-k",
        "3",
    ]
    assert cache_features_main(argv) == 0
    err = capsys.readouterr().err
    assert "bytes/token" in err and "redraft-train --recipe tiny --features" in err
    rec = FeatureRecords(
        tmp_path / "f",
        cfg=_cfg(tmp_path, tiny_target_dir, chat_file),
        record=target_record(tiny_target),
    )
    assert rec.top_k == 3 and rec.meta["data"]["max_length"] == 128  # the tiny recipe's records
    assert cache_features_main(argv) == 0  # complete: a second run has nothing to do
    assert "bytes/token" in capsys.readouterr().err


def test_distill_settings_matter_only_to_self_distilled_features():
    """KD-only features of plain records survive a recipe that distils more first turns; the
    features of distilled records do not."""
    from redraft.train.features import DATA_KEYS, check_features_match

    def meta(cfg):
        return {"target": {"name": "t"}, "data": {k: getattr(cfg, k) for k in DATA_KEYS}}

    plain = make_config("tiny", {"self_distill": False, "distill_limit": 512})
    check_features_match(meta(plain), "F", plain.replace(distill_limit=1024), {"name": "t"})
    with pytest.raises(ConfigError, match="train_limit"):
        check_features_match(meta(plain), "F", plain.replace(train_limit=7), {"name": "t"})
    distilled = make_config("tiny", {"self_distill": True, "distill_limit": 512})
    with pytest.raises(ConfigError, match="distill_limit"):
        check_features_match(
            meta(distilled), "F", distilled.replace(distill_limit=1024), {"name": "t"}
        )
