"""The n-gram artifact on disk and the decoder's batched lookups.

An artifact is a directory (DESIGN.md):

    ngrams.json            kinds, vocab_size, k, w, t, min_count, target + tokenizer fingerprint,
                           bigram context (BOS prefix), corpus stats, build seconds, build args,
                           and per file its byte size and sha256
    unigram.safetensors    ids int32 [k], probs float16 [k]
    bigram.safetensors     ids int32 [V, k], probs float16 [V, k]      (row x: successors of x)
    extended.safetensors   ids int32 [V, k, w]                         (ext[x, j, 0] = bigram[x, j])
    trigram.safetensors    context_keys int64 [C] (sorted w1 * V + w2), offsets int64 [C + 1],
                           ids int32 [nnz], probs float16 [nnz], context_counts int64 [C]

Each kind is its own file, so a later build can add a kind to an existing directory; files are
written atomically and ``ngrams.json`` last.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from redraft.errors import ArtifactError, ConfigError

FORMAT = "redraft-ngrams"
FORMAT_VERSION = 1
META_FILE = "ngrams.json"
KINDS = ("unigram", "bigram", "extended", "trigram")
FILES = {kind: f"{kind}.safetensors" for kind in KINDS}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_save(tensors: dict, path: Path) -> dict:
    from safetensors.numpy import save_file

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # the writer creates 0600 files; tables are meant to be shared
    os.replace(tmp, path)
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}


def _np(x, dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(dtype, copy=False)


def save_tables(directory, meta: dict, *, unigram=None, bigram=None, extended=None,
                trigram=None) -> Path:
    """Write the given tables into ``directory`` and update ``ngrams.json``.

    Args:
        directory: output directory (created; existing kinds not given are kept).
        meta: fields for ``ngrams.json``; must hold ``vocab_size`` and ``tokenizer_fingerprint``
            (``Target.artifact_metadata()`` plus build info). Per-kind entries (``k``, ``w``...)
            are merged into the existing file.
        unigram: ``(ids [k], probs [k])``.
        bigram: ``(ids [V, k], probs [V, k])``.
        extended: ``ids [V, k, w]``.
        trigram: a :class:`redraft.ngrams.trigrams.TrigramTable`.

    Returns:
        The directory.

    Raises:
        ArtifactError: the directory already holds tables of another tokenizer or vocabulary.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta_path = directory / META_FILE
    old = {}
    if meta_path.is_file():
        try:
            old = json.loads(meta_path.read_text())
        except json.JSONDecodeError:
            old = {}
        for key in ("tokenizer_fingerprint", "vocab_size"):
            if old.get(key) is not None and meta.get(key) is not None and old[key] != meta[key]:
                raise ArtifactError(
                    f"{meta_path} holds tables with {key}={old[key]!r}, but these were built "
                    f"with {key}={meta[key]!r}. Write them to another --output-dir.")
    files = dict(old.get("files", {}))
    if unigram is not None:
        files["unigram"] = _atomic_save({"ids": _np(unigram[0], np.int32),
                                         "probs": _np(unigram[1], np.float16)},
                                        directory / FILES["unigram"])
    if bigram is not None:
        files["bigram"] = _atomic_save({"ids": _np(bigram[0], np.int32),
                                        "probs": _np(bigram[1], np.float16)},
                                       directory / FILES["bigram"])
    if extended is not None:
        files["extended"] = _atomic_save({"ids": _np(extended, np.int32)},
                                         directory / FILES["extended"])
    if trigram is not None:
        files["trigram"] = _atomic_save({
            "context_keys": _np(trigram.context_keys, np.int64),
            "offsets": _np(trigram.offsets, np.int64),
            "ids": _np(trigram.ids, np.int32),
            "probs": _np(trigram.probs, np.float16),
            "context_counts": _np(trigram.context_counts, np.int64),
        }, directory / FILES["trigram"])
    out = dict(old)
    for key, value in meta.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    out.update(format=FORMAT, format_version=FORMAT_VERSION, files=files,
               kinds=[k for k in KINDS if k in files])
    tmp = meta_path.with_name(META_FILE + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(out, indent=2))
    os.replace(tmp, meta_path)
    return directory


def _resolve(path_or_dir) -> Path:
    path = Path(os.fspath(path_or_dir)).expanduser()
    if path.is_file() and path.name == META_FILE:
        path = path.parent
    if path.is_dir():
        return path
    try:
        from redraft.hub import resolve_artifact
    except ImportError:
        resolve_artifact = None
    if resolve_artifact is not None and not path.exists():
        return resolve_artifact(os.fspath(path_or_dir), kind="ngrams")
    raise ArtifactError(f"n-gram tables {path} not found: pass the directory that holds "
                        f"{META_FILE} (written by redraft-build-ngrams) or a hub REPO_ID[@rev].")


class NGramTables:
    """Loaded n-gram tables with batched, vectorised lookups (torch, any device).

    Attributes:
        kinds: the kinds present (subset of ``unigram, bigram, extended, trigram``).
        vocab_size, k, w, t: table shapes (``None`` for kinds not present).
        fingerprint: the tokenizer fingerprint the tables were built for.
        bos_prefix: the BOS id the bigram rows were conditioned on (None: rows are ``p(· | [x])``).
        meta: the ``ngrams.json`` dict.
    """

    def __init__(self, tensors: dict[str, dict[str, torch.Tensor]], meta: dict, path=None):
        self.meta = meta
        self.path = path
        self.vocab_size = int(meta["vocab_size"])
        self.fingerprint = meta.get("tokenizer_fingerprint")
        self._t = tensors
        self.kinds = [k for k in KINDS if k in tensors]
        self.k = int(tensors["bigram"]["ids"].shape[1]) if "bigram" in tensors else (
            int(tensors["unigram"]["ids"].shape[0]) if "unigram" in tensors else None)
        self.w = int(tensors["extended"]["ids"].shape[2]) if "extended" in tensors else None
        stored_t = meta.get("trigram", {}).get("t")
        self.t = int(stored_t) if "trigram" in tensors and stored_t else None
        self.bos_prefix = meta.get("bigram", {}).get("bos_prefix")
        self._dense = None  # padded tri-gram rows, made at the first lookup

    # ---------------------------------------------------------------- loading

    @classmethod
    def load(cls, path_or_dir, target=None, kinds=None, device=None, verify: bool = True) -> "NGramTables":
        """Load an artifact directory (or hub ``REPO_ID[@rev]``).

        Args:
            path_or_dir: the directory holding ``ngrams.json`` (or that file itself).
            target: when given, its tokenizer fingerprint and vocab size must match.
            kinds: load only these kinds (default all present).
            device: move the tables there.
            verify: check each file's size and sha256 against ``ngrams.json``.

        Raises:
            ArtifactError: missing, truncated or corrupted files, an unknown kind.
            FingerprintMismatchError: built for another tokenizer than ``target``'s.
        """
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = _resolve(path_or_dir)
        meta_path = directory / META_FILE
        if not meta_path.is_file():
            raise ArtifactError(f"{directory} holds no {META_FILE}: not an n-gram table directory "
                                f"(build one with redraft-build-ngrams).")
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{meta_path} is not valid JSON ({exc}); the build did not finish: "
                                f"rebuild the tables.") from exc
        if meta.get("format") != FORMAT or "vocab_size" not in meta:
            raise ArtifactError(f"{meta_path} is not a redraft n-gram table file "
                                f"(format {meta.get('format')!r}).")
        if target is not None:
            from redraft.models import check_fingerprint

            check_fingerprint(meta.get("tokenizer_fingerprint"), target, directory)
            if int(meta["vocab_size"]) != target.vocab_size:
                raise ArtifactError(f"{directory} was built for vocab size {meta['vocab_size']}, "
                                    f"the target {target.model_id!r} has {target.vocab_size}.")
        present = list(meta.get("files", {}))
        wanted = present if kinds is None else list(kinds)
        for kind in wanted:
            if kind not in KINDS:
                raise ConfigError(f"unknown n-gram kind {kind!r}; use one of {', '.join(KINDS)}.")
            if kind not in present:
                raise ArtifactError(f"{directory} has no {kind} table (it has: "
                                    f"{', '.join(present) or 'none'}); build it with "
                                    f"redraft-build-ngrams --kinds {kind}.")
        tensors = {}
        for kind in wanted:
            info = meta["files"][kind]
            path = directory / info["file"]
            if not path.is_file():
                raise ArtifactError(f"{path} is missing; {META_FILE} lists it. Rebuild the {kind} table.")
            size = path.stat().st_size
            if verify and size != info.get("bytes", size):
                raise ArtifactError(f"{path} has {size} bytes, {META_FILE} records {info['bytes']}: "
                                    f"truncated or replaced. Re-download or rebuild it.")
            if verify and info.get("sha256") and _sha256(path) != info["sha256"]:
                raise ArtifactError(f"{path} does not match the sha256 in {META_FILE}: corrupted. "
                                    f"Re-download or rebuild it.")
            try:
                tensors[kind] = load_file(str(path))
            except (SafetensorError, OSError, ValueError) as exc:
                raise ArtifactError(f"{path} cannot be read as safetensors ({exc}): truncated or "
                                    f"corrupted. Re-download or rebuild it.") from exc
        tables = cls(tensors, meta, path=directory)
        return tables.to(device) if device is not None else tables

    def to(self, device) -> "NGramTables":
        """Move every table to ``device`` (in place); returns self."""
        self._t = {kind: {n: v.to(device) for n, v in d.items()} for kind, d in self._t.items()}
        self._dense = None  # rebuilt on the new device at the next lookup
        return self

    @property
    def device(self) -> torch.device:
        for d in self._t.values():
            for v in d.values():
                return v.device
        return torch.device("cpu")

    def _need(self, kind: str) -> dict:
        if kind not in self._t:
            raise ArtifactError(f"{self.path or 'these tables'} hold no {kind} table "
                                f"(kinds: {', '.join(self.kinds) or 'none'}).")
        return self._t[kind]

    @staticmethod
    def _cols(k, have: int, name: str) -> int:
        if k is None:
            return have
        if not 1 <= int(k) <= have:
            raise ConfigError(f"{name}={k} but the table stores {have} columns; rebuild with a larger {name}.")
        return int(k)

    def table(self, kind: str) -> dict[str, torch.Tensor]:
        """The stored tensors of one kind, as on disk (module doc), on the tables' device."""
        return dict(self._need(kind))

    def trigram_csr(self) -> dict[str, torch.Tensor]:
        """The tri-gram table in CSR form: ``context_keys int64 [C]`` (sorted ``w1 * V + w2``),
        ``offsets int64 [C + 1]``, ``ids int32 [nnz]``, ``probs float16 [nnz]``,
        ``context_counts int64 [C]``. For decoders that keep their own copy (ADED overlays)."""
        return self.table("trigram")

    # ---------------------------------------------------------------- lookups

    def unigram_topk(self, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids long [k], probs float32 [k])``: the model unigram's most probable tokens."""
        u = self._need("unigram")
        k = self._cols(k, u["ids"].shape[0], "k")
        return u["ids"][:k].long(), u["probs"][:k].float()

    def bigram_topk(self, tokens: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k successors of each token: ``tokens [N]`` → ``(ids long [N, k], probs float32 [N, k])``."""
        b = self._need("bigram")
        k = self._cols(k, b["ids"].shape[1], "k")
        tokens = tokens.to(b["ids"].device, torch.long)
        return b["ids"][tokens, :k].long(), b["probs"][tokens, :k].float()

    def extended(self, tokens: torch.Tensor, k: int | None = None, w: int | None = None) -> torch.Tensor:
        """Extended rows: ``tokens [N]`` → ``ids long [N, k, w]``; ``[:, j, 0]`` is the j-th bigram successor."""
        e = self._need("extended")["ids"]
        k = self._cols(k, e.shape[1], "k")
        w = self._cols(w, e.shape[2], "w")
        return e[tokens.to(e.device, torch.long), :k, :w].long()

    # Above this many bytes the padded [C + 1, t] copy of the tri-gram table is not made and
    # lookups gather straight from the CSR arrays (slower, no extra memory).
    DENSE_TRIGRAM_MAX_BYTES = 1 << 30

    def _trigram_rows(self):
        """The tri-gram table padded to dense rows ``ids int32 [C + 1, t]``, ``probs f16 [C + 1, t]``.

        Row ``C`` is all ``-1`` / ``0``: the row of contexts that never occurred. One contiguous
        row gather per lookup replaces a ``[N, t]`` index computation, gather and mask. Built on
        first use (vectorised scatter), None when it would exceed ``DENSE_TRIGRAM_MAX_BYTES``.
        """
        if self._dense is not None:
            return self._dense
        tg = self._need("trigram")
        offsets, t = tg["offsets"], int(self.t or 1)
        C = len(tg["context_keys"])
        if (C + 1) * t * 6 > self.DENSE_TRIGRAM_MAX_BYTES:
            return None
        dev = offsets.device
        lengths = offsets[1:] - offsets[:-1]  # [C]
        row = torch.repeat_interleave(torch.arange(C, device=dev), lengths)  # [nnz]
        col = torch.arange(len(row), device=dev) - offsets[:-1][row]  # rank within its row
        ids = torch.full((C + 1, t), -1, dtype=torch.int32, device=dev)
        probs = torch.zeros((C + 1, t), dtype=tg["probs"].dtype, device=dev)
        ids[row, col] = tg["ids"]
        probs[row, col] = tg["probs"]
        self._dense = (ids, probs)
        return self._dense

    def trigram_successors(self, w1: torch.Tensor, w2: torch.Tensor,
                           t: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-t successors of each context ``(w1[i], w2[i])``.

        Returns:
            ``(ids long [N, t], probs float32 [N, t])``, most probable first; ``-1`` / ``0`` where
            the context has fewer successors or never occurred.
        """
        tg = self._need("trigram")
        keys, offsets = tg["context_keys"], tg["offsets"]
        t = self._cols(t, int(self.t or 1), "t")
        dev = keys.device
        C = len(keys)
        ctx = w1.to(dev, torch.long) * self.vocab_size + w2.to(dev, torch.long)  # [N]
        pos = torch.searchsorted(keys, ctx).clamp_(max=max(C - 1, 0))  # [N]
        found = keys[pos] == ctx if C else torch.zeros_like(ctx, dtype=torch.bool)
        dense = self._trigram_rows()
        if dense is not None:
            row = torch.where(found, pos, C)  # unseen contexts read the empty row C
            return dense[0][row, :t].long(), dense[1][row, :t].float()
        start = offsets[pos]  # [N]
        length = torch.where(found, offsets[pos + 1] - start, 0)  # [N]
        col = torch.arange(t, device=dev)  # [t]
        invalid = col >= length[:, None]  # [N, t]
        idx = (start[:, None] + col).clamp_(max=max(len(tg["ids"]) - 1, 0))  # [N, t]
        ids = tg["ids"][idx].long().masked_fill_(invalid, -1)
        probs = tg["probs"][idx].float().masked_fill_(invalid, 0.0)
        return ids, probs

    def __repr__(self) -> str:
        return (f"NGramTables(kinds={self.kinds}, vocab_size={self.vocab_size}, k={self.k}, "
                f"w={self.w}, t={self.t}, fingerprint={self.fingerprint!r}, device={self.device})")
