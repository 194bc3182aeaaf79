"""The n-gram artifact on disk and the decoder's batched lookups.

An artifact is a directory (docs/ngrams.md has the format):

    ngrams.json            kinds, vocab_size, k, w, t, min_count, target + tokenizer fingerprint,
                           bigram context (BOS prefix), corpus stats, build seconds, build args,
                           and per file its byte size and sha256
    unigram.safetensors    ids int32 [k], probs float16 [k]
    bigram.safetensors     ids int32 [V, k], probs float16 [V, k]      (row x: successors of x)
    extended.safetensors   ids int32 [V, k, w]                         (ext[x, j, 0] = bigram[x, j])
    trigram.safetensors    context_keys int64 [C] (sorted w1 * V + w2), offsets int64 [C + 1],
                           ids int32 [nnz], probs float16 [nnz], context_counts int64 [C]
                           (loaded as a redraft.ngrams.TrigramTable: NGramTables.trigram)

Each kind is its own file, so a later build can add a kind to an existing directory; files are
written atomically and ``ngrams.json`` last.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from redraft.errors import ArtifactError, ConfigError
from redraft.ngrams.format import FILES, FORMAT, FORMAT_VERSION, KINDS, META_FILE
from redraft.ngrams.trigram_table import TrigramTable
from redraft.utils import atomic_path, atomic_write_text, sha256_file


def _atomic_save(tensors: dict, path: Path) -> dict:
    """Write safetensors atomically (readers see the old file or the new one); its files entry."""
    from safetensors.numpy import save_file

    with atomic_path(path) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp))
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _np(x, dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(dtype, copy=False)


def save_tables(
    directory, meta: dict, *, unigram=None, bigram=None, extended=None, trigram=None
) -> Path:
    """Write the given tables into ``directory`` and update ``ngrams.json``.

    Args:
        directory: output directory (created; existing kinds not given are kept).
        meta: fields for ``ngrams.json``; must hold ``vocab_size`` and ``tokenizer_fingerprint``
            (``Target.artifact_metadata()`` plus build info). Per-kind entries (``k``, ``w``...)
            are merged into the existing file.
        unigram: ``(ids [k], probs [k])``.
        bigram: ``(ids [V, k], probs [V, k])``.
        extended: ``ids [V, k, w]``.
        trigram: a :class:`~redraft.ngrams.trigram_table.TrigramTable`; its ``t`` and
            ``min_count`` are recorded under ``trigram`` unless ``meta`` gives them.

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
                    f"with {key}={meta[key]!r}. Write them to another --output-dir."
                )
    files = dict(old.get("files", {}))
    if unigram is not None:
        files["unigram"] = _atomic_save(
            {"ids": _np(unigram[0], np.int32), "probs": _np(unigram[1], np.float16)},
            directory / FILES["unigram"],
        )
    if bigram is not None:
        files["bigram"] = _atomic_save(
            {"ids": _np(bigram[0], np.int32), "probs": _np(bigram[1], np.float16)},
            directory / FILES["bigram"],
        )
    if extended is not None:
        files["extended"] = _atomic_save(
            {"ids": _np(extended, np.int32)}, directory / FILES["extended"]
        )
    if trigram is not None:
        if not isinstance(trigram, TrigramTable):
            raise ConfigError(
                f"save_tables(trigram=...) takes a redraft.ngrams.TrigramTable, got "
                f"{type(trigram).__name__}; build one with TrigramTable.from_csr(...).",
                param="trigram",
            )
        files["trigram"] = _atomic_save(trigram.to_arrays(), directory / FILES["trigram"])
        meta = dict(
            meta,
            trigram={"t": trigram.t, "min_count": trigram.min_count, **(meta.get("trigram") or {})},
        )
    out = dict(old)
    for key, value in meta.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    out.update(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        files=files,
        kinds=[k for k in KINDS if k in files],
    )
    atomic_write_text(meta_path, json.dumps(out, indent=2))
    return directory


def _resolve(path_or_dir) -> Path:
    path = Path(os.fspath(path_or_dir)).expanduser()
    if path.is_file() and path.name == META_FILE:
        path = path.parent
    if path.is_dir():
        return path
    try:
        from redraft.hub.resolve import resolve_artifact
    except ImportError:
        resolve_artifact = None
    if resolve_artifact is not None and not path.exists():
        return resolve_artifact(os.fspath(path_or_dir), kind="ngrams")
    raise ArtifactError(
        f"n-gram tables {path} not found: pass the directory that holds "
        f"{META_FILE} (written by redraft-build-ngrams) or a hub REPO_ID[@rev]."
    )


def _read_meta(directory: Path, verify: bool) -> dict:
    """``ngrams.json`` of ``directory``, checked: every key the loader reads is present and sane.

    Raises:
        ArtifactError: naming the file and the missing or wrong key.
    """
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise ArtifactError(
            f"{directory} holds no {META_FILE}: not an n-gram table directory "
            f"(build one with redraft-build-ngrams)."
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(
            f"{meta_path} is not valid JSON ({exc}); the build did not finish: rebuild the tables."
        ) from exc

    def bad(what: str) -> ArtifactError:
        return ArtifactError(
            f"{meta_path} {what}. It was not written by redraft-build-ngrams or "
            f"was edited: rebuild the tables (or restore the file)."
        )

    if not isinstance(meta, dict):
        raise bad(f"holds a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT:
        raise bad(
            f"has format {meta.get('format')!r}, not {FORMAT!r}: not a redraft n-gram table file"
        )
    for key in ("vocab_size", "files"):
        if key not in meta:
            raise bad(f"lacks the key {key!r}")
    V = meta["vocab_size"]
    if isinstance(V, bool) or not isinstance(V, int) or V < 1:
        raise bad(f"has vocab_size {V!r}; want a positive integer")
    files = meta["files"]
    if not isinstance(files, dict) or not files:
        raise bad(f"has files {files!r}; want an object with one entry per table kind")
    unknown = sorted(set(files) - set(KINDS))
    if unknown:
        raise bad(f"lists unknown table kind(s) {unknown} under 'files'; known: {', '.join(KINDS)}")
    if "kinds" in meta and list(meta["kinds"]) != [k for k in KINDS if k in files]:
        raise bad(f"says kinds {meta['kinds']!r} but its 'files' hold {list(files)}")
    for kind, info in files.items():
        if not isinstance(info, dict) or "file" not in info:
            raise bad(f"has no file name for the {kind} table (files.{kind}.file)")
        name = info["file"]
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise bad(
                f"names the {kind} file {name!r}; want a plain file name inside the directory"
            )
        for key in ("bytes", "sha256") if verify else ():
            if key not in info:
                raise bad(
                    f"lacks files.{kind}.{key} (needed to verify the file; "
                    f"load with verify=False to skip the check)"
                )
    return meta


def _trigram_from_arrays(arrays: dict, meta: dict) -> TrigramTable:
    """The :class:`TrigramTable` of stored arrays (names as in ``trigram.safetensors``)."""
    missing = [n for n in ("context_keys", "offsets", "ids", "probs") if n not in arrays]
    if missing:
        raise ArtifactError(f"the tri-gram file lacks the arrays {missing}; rebuild the table.")
    info = meta.get("trigram") if isinstance(meta.get("trigram"), dict) else {}
    return TrigramTable(
        arrays["context_keys"],
        arrays["offsets"],
        arrays["ids"],
        arrays["probs"],
        int(meta["vocab_size"]),
        t=info.get("t"),
        min_count=info.get("min_count") or 1,
        context_counts=arrays.get("context_counts"),
        stats=info.get("corpus"),
    )


class NGramTables:
    """Loaded n-gram tables with batched, vectorised lookups (torch, any device).

    Attributes:
        kinds: the kinds present (subset of ``unigram, bigram, extended, trigram``).
        vocab_size, k, w, t: table shapes (``None`` for kinds not present).
        fingerprint: the tokenizer fingerprint the tables were built for.
        bos_prefix: the BOS id the bigram rows were conditioned on (None: rows are ``p(· | [x])``).
        trigram: the :class:`~redraft.ngrams.trigram_table.TrigramTable` (ArtifactError when absent).
        meta: the ``ngrams.json`` dict.
    """

    def __init__(
        self,
        tensors: dict[str, dict[str, torch.Tensor]],
        meta: dict,
        path=None,
        trigram: TrigramTable | None = None,
    ):
        """``tensors``: ``{kind: {name: tensor}}`` for unigram/bigram/extended (names as on disk);
        ``trigram``: the tri-gram table (or its stored arrays as ``tensors["trigram"]``)."""
        self.meta = meta
        self.path = path
        self.vocab_size = int(meta["vocab_size"])
        self.fingerprint = meta.get("tokenizer_fingerprint")
        tensors = dict(tensors)
        if "trigram" in tensors:
            trigram = _trigram_from_arrays(tensors.pop("trigram"), meta)
        if trigram is not None and trigram.vocab_size != self.vocab_size:
            raise ArtifactError(
                f"the tri-gram table packs vocab size {trigram.vocab_size}, the "
                f"tables say {self.vocab_size}."
            )
        self._t = tensors
        self._trigram = trigram
        self._device = torch.device("cpu")
        self.kinds = [k for k in KINDS if k in tensors or (k == "trigram" and trigram is not None)]
        self.k = (
            int(tensors["bigram"]["ids"].shape[1])
            if "bigram" in tensors
            else (int(tensors["unigram"]["ids"].shape[0]) if "unigram" in tensors else None)
        )
        self.w = int(tensors["extended"]["ids"].shape[2]) if "extended" in tensors else None
        self.t = trigram.t if trigram is not None else None
        self.bos_prefix = (meta.get("bigram") or {}).get("bos_prefix")

    # ---------------------------------------------------------------- loading

    @classmethod
    def load(
        cls, path_or_dir, target=None, kinds=None, device=None, verify: bool = True
    ) -> NGramTables:
        """Load an artifact directory (or hub ``REPO_ID[@rev]``).

        Args:
            path_or_dir: the directory holding ``ngrams.json`` (or that file itself).
            target: when given, its tokenizer fingerprint and vocab size must match.
            kinds: load only these kinds (default all present).
            device: move the tables there.
            verify: check each file's size and sha256 against ``ngrams.json``.

        Raises:
            ArtifactError: a ``ngrams.json`` that lacks a key (named) or lists an unknown kind;
                missing, truncated or corrupted files.
            ConfigError: an unknown kind in ``kinds``.
            FingerprintMismatchError: built for another tokenizer than ``target``'s.
        """
        from safetensors import SafetensorError
        from safetensors.numpy import load_file as load_numpy
        from safetensors.torch import load_file

        directory = _resolve(path_or_dir)
        meta = _read_meta(directory, verify)
        if target is not None:
            from redraft.models import check_fingerprint

            check_fingerprint(meta.get("tokenizer_fingerprint"), target, directory)
            if int(meta["vocab_size"]) != target.vocab_size:
                raise ArtifactError(
                    f"{directory} was built for vocab size {meta['vocab_size']}, "
                    f"the target {target.model_id!r} has {target.vocab_size}."
                )
        present = list(meta["files"])
        wanted = present if kinds is None else list(kinds)
        for kind in wanted:
            if kind not in KINDS:
                raise ConfigError(
                    f"unknown n-gram kind {kind!r}; use one of {', '.join(KINDS)}.", param="kinds"
                )
            if kind not in present:
                raise ArtifactError(
                    f"{directory} has no {kind} table (it has: "
                    f"{', '.join(present) or 'none'}); build it with "
                    f"redraft-build-ngrams --kinds {kind}."
                )
        tensors, trigram = {}, None
        for kind in wanted:
            info = meta["files"][kind]
            path = directory / info["file"]
            if not path.is_file():
                raise ArtifactError(
                    f"{path} is missing; {META_FILE} lists it. Rebuild the {kind} table."
                )
            size = path.stat().st_size
            if verify and size != info["bytes"]:
                raise ArtifactError(
                    f"{path} has {size} bytes, {META_FILE} records {info['bytes']}: "
                    f"truncated or replaced. Re-download or rebuild it."
                )
            if verify and sha256_file(path) != info["sha256"]:
                raise ArtifactError(
                    f"{path} does not match the sha256 in {META_FILE}: corrupted. "
                    f"Re-download or rebuild it."
                )
            try:
                if kind == "trigram":  # host numpy: ADED's search and the lookups run there
                    trigram = _trigram_from_arrays(load_numpy(str(path)), meta)
                else:
                    tensors[kind] = load_file(str(path))
            except (SafetensorError, OSError, ValueError) as exc:
                raise ArtifactError(
                    f"{path} cannot be read as safetensors ({exc}): truncated or "
                    f"corrupted. Re-download or rebuild it."
                ) from exc
        tables = cls(tensors, meta, path=directory, trigram=trigram)
        return tables.to(device) if device is not None else tables

    def to(self, device) -> NGramTables:
        """Move every table to ``device`` (in place); returns self. The tri-gram table keeps its
        host arrays (ADED searches there) and prepares a copy on ``device`` for torch lookups."""
        self._t = {kind: {n: v.to(device) for n, v in d.items()} for kind, d in self._t.items()}
        self._device = torch.device(device)
        if self._trigram is not None:
            self._trigram.to(self._device)
        return self

    @property
    def device(self) -> torch.device:
        for d in self._t.values():
            for v in d.values():
                return v.device
        return self._device

    def _need(self, kind: str) -> dict:
        if kind not in self._t:
            raise ArtifactError(
                f"{self.path or 'these tables'} hold no {kind} table "
                f"(kinds: {', '.join(self.kinds) or 'none'})."
            )
        return self._t[kind]

    @staticmethod
    def _cols(k, have: int, name: str) -> int:
        if k is None:
            return have
        if not 1 <= int(k) <= have:
            raise ConfigError(
                f"{name}={k} but the table stores {have} columns; rebuild with a larger {name}.",
                param=name,
            )
        return int(k)

    @property
    def trigram(self) -> TrigramTable:
        """The tri-gram table (:class:`~redraft.ngrams.trigram_table.TrigramTable`): what ADED's
        search, its adaptive overlay and HSDDW's tri-gram model read."""
        if self._trigram is None:
            raise ArtifactError(
                f"{self.path or 'these tables'} hold no trigram table (kinds: "
                f"{', '.join(self.kinds) or 'none'}). Build one with `redraft-build-ngrams "
                f"--kinds trigram --data default-chat --output-dir DIR` and pass that directory."
            )
        return self._trigram

    def table(self, kind: str) -> dict[str, torch.Tensor]:
        """The stored tensors of one kind, as on disk (module doc), on the tables' device."""
        if kind == "trigram":
            return {
                n: torch.from_numpy(np.array(a)).to(self.device)  # a copy: the table is shared
                for n, a in self.trigram.to_arrays().items()
            }
        return dict(self._need(kind))

    # ---------------------------------------------------------------- lookups

    def unigram_topk(self, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids long [k], probs float32 [k])``: the model unigram's most probable tokens."""
        u = self._need("unigram")
        k = self._cols(k, u["ids"].shape[0], "k")
        return u["ids"][:k].long(), u["probs"][:k].float()

    def bigram_topk(
        self, tokens: torch.Tensor, k: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k successors of each token: ``tokens [N]`` → ``(ids long [N, k], probs float32 [N, k])``."""
        b = self._need("bigram")
        k = self._cols(k, b["ids"].shape[1], "k")
        tokens = tokens.to(b["ids"].device, torch.long)
        return b["ids"][tokens, :k].long(), b["probs"][tokens, :k].float()

    def extended(
        self, tokens: torch.Tensor, k: int | None = None, w: int | None = None
    ) -> torch.Tensor:
        """Extended rows: ``tokens [N]`` → ``ids long [N, k, w]``; ``[:, j, 0]`` is the j-th bigram successor."""
        e = self._need("extended")["ids"]
        k = self._cols(k, e.shape[1], "k")
        w = self._cols(w, e.shape[2], "w")
        return e[tokens.to(e.device, torch.long), :k, :w].long()

    def trigram_successors(
        self, w1: torch.Tensor, w2: torch.Tensor, t: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-t successors of each context ``(w1[i], w2[i])`` on the tables' device
        (:meth:`TrigramTable.successors <redraft.ngrams.trigram_table.TrigramTable.successors>`).

        Returns:
            ``(ids long [N, t], probs float32 [N, t])``, most probable first; ``-1`` / ``0`` where
            the context has fewer successors or never occurred.
        """
        tg = self.trigram
        t = self._cols(t, tg.t, "t")
        dev = self.device
        return tg.successors(w1.to(dev), w2.to(dev), t)

    def __repr__(self) -> str:
        return (
            f"NGramTables(kinds={self.kinds}, vocab_size={self.vocab_size}, k={self.k}, "
            f"w={self.w}, t={self.t}, fingerprint={self.fingerprint!r}, device={self.device})"
        )


def as_trigram_table(tables) -> TrigramTable:
    """The tri-gram table of what a drafter is given: a :class:`TrigramTable` (returned as it is)
    or loaded :class:`NGramTables` (their :attr:`trigram`).

    Raises:
        ArtifactError: n-gram tables without a tri-gram kind (the message says how to build one).
        ConfigError: anything else.
    """
    if isinstance(tables, TrigramTable):
        return tables
    if isinstance(tables, NGramTables):
        return tables.trigram
    raise ConfigError(
        f"expected a redraft.ngrams.TrigramTable or NGramTables, got "
        f"{type(tables).__name__}; load tables with NGramTables.load(DIR) or build "
        f"one with TrigramTable.from_csr(...) / trigram_table_from_token_arrays(...)."
    )
