"""Cached target features: run the frozen target once, train many epochs without it.

``redraft-cache-features --target T --data SPEC --output-dir DIR`` stores, for every token of
the training records (the same records ``redraft-train`` would draw: the train split of the
data spec, after ``max_length``/``pack``/``train_limit``), the target's last hidden state and its
top-k next-token logits; ``redraft-train --features DIR`` then trains with no target forward.
For a 7-8B target that forward is most of a training step's compute.

Layout of ``DIR``::

    features.json             format, the target's record (id, tokenizer and weights
                              fingerprints), the data settings, top_k, dtypes, the shard plan,
                              "complete": true once every shard is written
    shard-00000.safetensors   one contiguous range of records, tokens concatenated:
                                hidden       [N, F]  bfloat16 (or float32 / float16); F = H,
                                                     or k*H: the k layers "hidden_layers" of
                                                     features.json (--head-features multi)
                                topk_ids     [N, k]  int32    the target's top-k next tokens
                                topk_logits  [N, k]  float32  their logits
                                input_ids    [N]     int32
                                loss_mask    [N]     uint8
                                offsets      [R+1]   int64    record r is tokens offsets[r]:offsets[r+1]

Shards are plain safetensors files (any tool reads them); this module reads them as numpy
memory maps at the offsets the header gives, so a micro batch costs one slice copy per record
(no Python loop over tokens) and nothing is loaded up front. A shard is written whole to a
temporary file and renamed, so a killed run keeps every finished shard and continues with the
next one when started again with the same arguments. A shard whose size disagrees with its
header (a truncated copy) is named in the error, and rewritten by a resumed cache run.

The package's modules: :mod:`~redraft.train.features.layout` (the format's names and sizes, the
shard plan), :mod:`~redraft.train.features.reader` (``features.json``, memory-mapped shards,
:class:`FeatureRecords`) and :mod:`~redraft.train.features.writer` (:func:`cache_features`);
their names are importable from here.
"""

from __future__ import annotations

from redraft.train.config import DEFAULT_TOP_K, HIDDEN_DTYPES
from redraft.train.features.layout import (
    DATA_KEYS,
    FORMAT,
    META_FILE,
    bytes_per_token,
    data_settings,
    shard_name,
    shard_plan,
)
from redraft.train.features.reader import (
    FeatureRecords,
    check_features_match,
    open_shard,
    read_features_meta,
)
from redraft.train.features.writer import cache_features, disk_bytes, head_layers

__all__ = [
    "cache_features",
    "FeatureRecords",
    "read_features_meta",
    "open_shard",
    "check_features_match",
    "shard_plan",
    "bytes_per_token",
    "disk_bytes",
    "DEFAULT_TOP_K",
    "HIDDEN_DTYPES",
    # the format's names, and the helpers other modules and the tests read
    "DATA_KEYS",
    "FORMAT",
    "META_FILE",
    "data_settings",
    "head_layers",
    "shard_name",
]
