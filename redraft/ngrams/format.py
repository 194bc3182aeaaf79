"""Names of the n-gram artifact on disk, in one place (no heavy imports: CLIs read them at
``--help`` time). :mod:`redraft.ngrams.tables` documents the layout."""

FORMAT = "redraft-ngrams"
FORMAT_VERSION = 1
META_FILE = "ngrams.json"
KINDS = ("unigram", "bigram", "extended", "trigram")
FILES = {kind: f"{kind}.safetensors" for kind in KINDS}
# Where a sharded tri-gram build writes its partial counts (inside --output-dir), and where a
# merge moves them afterwards so that the artifact directory holds exactly one artifact.
SHARD_GLOB = "trigram-counts-*-of-*"
SHARDS_SUFFIX = ".shards"


def shard_dir_name(shard_id: int, num_shards: int) -> str:
    """The directory name of shard ``shard_id`` of ``num_shards``."""
    return f"trigram-counts-{shard_id:05d}-of-{num_shards:05d}"
