"""redraft-demo caches the target's features of its records once, reuses them, and replaces
features of other records."""

import json

from redraft import demo
from redraft.train.config import make_config


def test_demo_features_are_cached_once_and_replaced_for_other_records(
    tmp_path, tiny_target_dir, chat_file
):
    def cfg(max_length):
        return make_config(
            "tiny",
            {
                "target": str(tiny_target_dir),
                "data": f"sharegpt:{chat_file}",
                "max_length": str(max_length),
                "num_proc": "1",
                "data_cache_dir": str(tmp_path / "data"),
                "train_limit": "8",
            },
        )

    path = tmp_path / "feats"
    assert demo.cache_demo_features(cfg(64), path) == path
    meta = json.loads((path / "features.json").read_text())
    assert meta["complete"] and meta["data"]["max_length"] == 64
    shard = path / meta["shards"][0]["file"]
    mtime = shard.stat().st_mtime_ns
    demo.cache_demo_features(cfg(64), path)  # the same records: kept as they are
    assert shard.stat().st_mtime_ns == mtime
    demo.cache_demo_features(cfg(96), path)  # other records: cached again
    assert json.loads((path / "features.json").read_text())["data"]["max_length"] == 96


def test_the_demo_kd_records_are_plain_records_of_the_same_data():
    cfg = make_config("demo")
    kd = demo.kd_records_config(cfg)
    assert cfg.self_distill and not kd.self_distill  # the records as they are: no generation
    assert kd.train_limit == demo.KD_RECORDS and kd.data == cfg.data
    assert kd.max_length == cfg.max_length and kd.heldout_fraction == cfg.heldout_fraction
