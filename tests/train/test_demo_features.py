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
    meta = demo.cache_demo_features(cfg(64), path)
    assert meta == json.loads((path / "features.json").read_text())
    assert meta["complete"] and meta["data"]["max_length"] == 64
    shard = path / meta["shards"][0]["file"]
    mtime = shard.stat().st_mtime_ns
    demo.cache_demo_features(cfg(64), path)  # the same records: kept as they are
    assert shard.stat().st_mtime_ns == mtime
    demo.cache_demo_features(cfg(96), path)  # other records: cached again
    assert json.loads((path / "features.json").read_text())["data"]["max_length"] == 96


def test_train_head_times_replies_features_and_training_then_reuses_the_head(
    tmp_path, tiny_target_dir, chat_file
):
    """redraft-demo's stage 2 on the tiny target: the replies are distilled (one target for the
    three parts), their features cached, the head trained; each part is a row of the closing
    table whose figures are the files' own. A second call reuses the head."""
    over = {
        "data": f"sharegpt:{chat_file}",
        "self_distill": "true",
        "distill_limit": "12",
        "distill_max_new_tokens": "8",
        "distill_dir": str(tmp_path / "distilled"),
        "eval_limit": "4",
        "num_proc": "1",
        "data_cache_dir": str(tmp_path / "data"),
        "report_to": "none",
    }
    out = tmp_path / "head"
    stages = demo.Stages()
    assert demo.train_head(str(tiny_target_dir), out, "tiny", 0.5, False, stages, over) == out
    names = [r[0] for r in stages.rows]
    assert names == ["self-distilled replies", "target features", "head training + held-out eval"]
    assert all(r[1] > 0 for r in stages.rows)
    replies = (tmp_path / "distilled" / "train.jsonl").read_text().splitlines()
    assert stages.rows[0][2].startswith(f"{len(replies)} conversations")
    meta = json.loads((tmp_path / "head-features" / "features.json").read_text())
    assert meta["records"] == len(replies)
    assert stages.rows[1][2] == f"{meta['tokens']:,} tokens of {meta['records']} records"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["features"] and f"tau_est {metrics['eval_tau_est']:.3f}" in stages.rows[2][2]
    assert f"{metrics['global_step']} steps" in stages.rows[2][2]

    again = demo.Stages()
    demo.train_head(str(tiny_target_dir), out, "tiny", 0.5, False, again, over)
    assert again.rows == [("head", None, f"reused {out}")]
