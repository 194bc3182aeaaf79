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
