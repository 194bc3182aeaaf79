"""Sorted tri-gram count runs on disk and the private spill directories that hold them.

A run is ``keys.bin`` + ``counts.bin`` (raw little-endian arrays, memory-mappable) and a
``meta.json`` that records the entry count (so truncation is detected) and, for a shard's saved
counts, each file's sha256. The counter (:mod:`redraft.ngrams.trigrams`) spills runs into a
:class:`SpillDir` when its in-memory counts outgrow their budget; ``redraft-build-ngrams``
removes the spill directories of builds that were killed (:func:`clean_stale_spills`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path

import numpy as np

from redraft.errors import ArtifactError
from redraft.ngrams.trigram_keys import WIDE
from redraft.utils import sha256_file

try:
    import fcntl
except ImportError:  # not POSIX: spill directories are recognised as stale by age
    fcntl = None

COUNTS_FORMAT = "redraft-trigram-counts"
COUNTS_FORMAT_VERSION = 1


def write_run(directory: Path, keys: np.ndarray, counts: np.ndarray, meta: dict) -> Path:
    """Write one sorted run atomically as ``directory/{keys,counts}.bin`` + ``meta.json``."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    np.ascontiguousarray(keys).tofile(tmp / "keys.bin")
    np.ascontiguousarray(counts, dtype=np.int64).tofile(tmp / "counts.bin")
    meta = dict(
        meta,
        format=COUNTS_FORMAT,
        format_version=COUNTS_FORMAT_VERSION,
        entries=int(len(keys)),
        key_dtype="int64" if keys.dtype != WIDE else "wide",
    )
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


def open_run(directory: Path, verify: bool = False) -> tuple[np.ndarray, np.ndarray, dict]:
    """Memory-map a run written by :func:`write_run` or :meth:`redraft.ngrams.trigrams.TrigramCounts.save`.

    ArtifactError when missing or truncated, and with ``verify`` when a file's sha256 differs
    from the one ``meta.json`` records (a shard changed after it was written).
    """
    directory = Path(directory)
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except FileNotFoundError as exc:
        raise ArtifactError(
            f"{directory} holds no meta.json: not a tri-gram count directory "
            f"(written by redraft-build-ngrams --num-shards)."
        ) from exc
    except json.JSONDecodeError as exc:
        raise ArtifactError(
            f"{directory / 'meta.json'} is not valid JSON ({exc}); the shard "
            f"was not written completely: rerun that shard."
        ) from exc
    if meta.get("format") != COUNTS_FORMAT:
        raise ArtifactError(
            f"{directory / 'meta.json'} is not a tri-gram count file "
            f"(format {meta.get('format')!r})."
        )
    kd = np.dtype(np.int64) if meta.get("key_dtype") == "int64" else WIDE
    n = int(meta["entries"])
    arrays = []
    for name, dt in (("keys.bin", kd), ("counts.bin", np.dtype(np.int64))):
        path = directory / name
        size = path.stat().st_size if path.exists() else -1
        if size != n * dt.itemsize:
            raise ArtifactError(
                f"{path} has {size} bytes, expected {n * dt.itemsize} "
                f"({n} entries): truncated or missing. Rerun the shard that wrote it."
            )
        want = (meta.get("sha256") or {}).get(name)
        if verify and want and sha256_file(path) != want:
            raise ArtifactError(
                f"{path} does not match the sha256 its meta.json records: it changed "
                f"after the shard wrote it. Rerun that shard (shard_id "
                f"{meta.get('shard_id', '?')}) and merge again."
            )
        arrays.append(np.memmap(path, dtype=dt, mode="r", shape=(n,)) if n else np.empty(0, dt))
    return arrays[0], arrays[1], meta


# --------------------------------------------------------------------------------------------
# spill directories: private, locked while their owner runs, removed when it ends or by the next
# build after a kill

SPILL_PREFIX = ".trigram-spill-"
_LEGACY_SPILL_PREFIX = "redraft-trigrams-"  # what builds before the lock wrote (system temp dir)
_LOCK = "owner.lock"


def _remove_spill(path: Path, lock) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if lock is not None:
        lock.close()  # closing releases the flock


class SpillDir:
    """A private directory ``ROOT/.trigram-spill-XXXXXXXX`` for one counter's spilled runs.

    Its owner holds an exclusive ``flock`` on ``owner.lock`` inside it for as long as it lives;
    the kernel releases the lock when the process dies in any way (SIGKILL included), which is
    how :func:`clean_stale_spills` tells a dead owner's leftovers from a running build's (works
    for concurrent shard jobs on one machine and on shared file systems with POSIX locks).
    :meth:`cleanup` (also run when the object is collected, and at interpreter exit) removes it.
    """

    def __init__(self, root):
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=root))
        # Lock first, then give the file its name: a cleaner never sees an unlocked owner.lock
        # of a live process (a folder without one is judged by its age).
        lock = open(self.path / (_LOCK + ".new"), "w")
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(self.path / (_LOCK + ".new"), self.path / _LOCK)
        self._finalizer = weakref.finalize(self, _remove_spill, self.path, lock)

    @property
    def name(self) -> str:
        return str(self.path)

    def cleanup(self) -> None:
        """Remove the directory and release the lock (idempotent)."""
        self._finalizer()


def clean_stale_spills(root, min_age_s: float = 600.0) -> list[Path]:
    """Remove spill directories under ``root`` whose owner no longer runs; return them.

    A directory whose ``owner.lock`` can be locked has a dead owner. One without a lock file (a
    build killed within microseconds of creating it, or one from before locks were used) is
    removed once it is ``min_age_s`` old.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for d in sorted([*root.glob(SPILL_PREFIX + "*"), *root.glob(_LEGACY_SPILL_PREFIX + "*")]):
        if not d.is_dir():
            continue
        lock_path = d / _LOCK
        try:
            if lock_path.exists() and fcntl is not None:
                with open(lock_path, "a") as lock:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        stale = True  # nobody holds it: the owner is gone (closing releases it)
                    except BlockingIOError:
                        stale = False  # a running build owns it
            else:
                stale = time.time() - d.stat().st_mtime > min_age_s
        except OSError:  # removed meanwhile, or unreadable: not ours to judge
            stale = False
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed
