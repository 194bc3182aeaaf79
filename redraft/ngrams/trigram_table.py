"""THE tri-gram table: ADED's pruned ``P(w3 | w1, w2)`` in CSR form, with one batched lookup.

Every user of corpus tri-grams goes through :class:`TrigramTable`: the builder
(:func:`redraft.ngrams.trigrams.build_trigram_table` returns one), the artifact
(:attr:`redraft.ngrams.NGramTables.trigram` loads one), ADED's MCTS and adaptive overlay, and
HSDDW's tri-gram draft model.

Layout (``C`` contexts, ``E`` entries)::

    context_keys  int64 [C]      sorted, w1 * V + w2
    offsets       int64 [C + 1]  context i's successors are ids[offsets[i]:offsets[i + 1]]
    ids           int64 [E]      successor ids, most probable first (ties: smaller id first)
    probs         float32 [E]    C(w1, w2, w3) / C(w1, w2)  (C(w1, w2) before pruning: rows sum to <= 1)

Worked example (V = 10): counted tri-grams (1,2,5) x1, (1,2,6) x3, (1,2,7) x2, (2,3,9) x4 give
``context_keys = [12, 23]``, ``offsets = [0, 3, 4]``, ``ids = [6, 7, 5, 9]``,
``probs = [3/6, 2/6, 1/6, 1]``. ``successors([1, 2, 4], [2, 3, 4], k=2)`` binary-searches the
keys ``[12, 23, 44]`` (44 is absent) and returns ``ids [[6, 7], [9, -1], [-1, -1]]``,
``probs [[.5, .33], [1, 0], [0, 0]]``.

The lookup (:meth:`TrigramTable.successors`) is one function for numpy arrays on the host (ADED's
MCTS calls it with 24-150 contexts at a time) and torch tensors on any device (the decoder's
batched lookups): ``searchsorted`` on the keys, then one row gather from a padded ``[C + 1, width]``
copy of the table (row ``C`` is empty: the row of every unseen context), made at the first lookup;
above :attr:`TrigramTable.DENSE_MAX_BYTES` it gathers from the CSR arrays instead (no extra
memory, about 1.7x slower). docs/ngrams.md has the measured figures.
"""

from __future__ import annotations

import numpy as np

from redraft.errors import ArtifactError, ConfigError

# The names the arrays have on disk (trigram.safetensors) and in :meth:`TrigramTable.to_arrays`.
ARRAY_NAMES = ("context_keys", "offsets", "ids", "probs", "context_counts")
_KEY_SENTINEL = np.iinfo(np.int64).max  # sorts after every key, equals none (keys < V * V)


def host_array(a, dtype=None) -> np.ndarray:
    """A 1-D numpy array from numpy, a list or a torch tensor (any device)."""
    if hasattr(a, "detach"):  # a torch tensor; no torch import needed here
        a = a.detach().cpu().numpy()
    a = np.asarray(a)
    return a if dtype is None else a.astype(dtype, copy=False)


class TrigramTable:
    """Top-t successors of every tri-gram context, in CSR form on the host (numpy).

    Build one with :meth:`from_csr` (four arrays), the builder's
    :func:`~redraft.ngrams.trigram_table_from_trigrams` (counted tri-grams),
    :func:`~redraft.ngrams.trigram_table_from_token_arrays` (token ids, counted with the n-gram
    stage's counter), :func:`redraft.ngrams.build_trigram_table` (counts of any size), or load
    it with ``NGramTables.load(dir).trigram``. This module imports none of them: the builder
    (:mod:`redraft.ngrams.trigrams`) and the artifact (:mod:`redraft.ngrams.tables`) import it.

    Attributes:
        vocab_size: ``V`` of the packing ``w1 * V + w2``.
        context_keys, offsets, ids, probs: the CSR arrays (module doc; read-only views).
        context_counts: int64 ``[C]`` ``C(w1, w2)`` before pruning, or ``None`` when unknown.
        t: successors kept per context when the table was pruned (``>= max_successors``).
        max_successors: the longest row.
        min_count: tri-grams seen fewer times were dropped.
        stats: corpus statistics of the build (records, tokens, trigrams, contexts, entries).
    """

    # Above this many bytes the padded [C + 1, width] copy is not made and lookups gather from
    # the CSR arrays (int32 ids + float32 probs: 8 bytes per slot; 1,016,413 x 12 ShareGPT
    # contexts take 98 MB).
    DENSE_MAX_BYTES = 1 << 30

    def __init__(
        self,
        context_keys,
        offsets,
        ids,
        probs,
        vocab_size: int,
        *,
        t: int | None = None,
        min_count: int = 1,
        context_counts=None,
        stats: dict | None = None,
    ):
        keys = host_array(context_keys, np.int64)
        offsets = np.ascontiguousarray(host_array(offsets, np.int64))
        ids, probs = host_array(ids), host_array(probs)
        self.vocab_size = int(vocab_size)
        _check_csr(keys, offsets, ids, probs, self.vocab_size)
        C, E = keys.size, ids.size
        # Sentinel-padded arrays are the storage; the public arrays are read-only views without
        # the pad (the table is shared by every drafter and request: nobody may write it).
        # A miss maps to context C, whose range [E, E) is empty, and entry E is (-1, 0).
        self._keys_pad = np.append(keys, np.int64(_KEY_SENTINEL))  # [C + 1]
        self._off_pad = np.append(offsets, np.int64(E))  # [C + 2]
        self._ids_pad = np.append(ids.astype(np.int64, copy=False), np.int64(-1))  # [E + 1]
        self._probs_pad = np.append(
            probs.astype(np.float32, copy=False), np.float32(0.0)
        )  # [E + 1]
        self.context_keys, self.offsets = (
            _readonly(self._keys_pad[:C]),
            _readonly(self._off_pad[: C + 1]),
        )
        self.ids, self.probs = _readonly(self._ids_pad[:E]), _readonly(self._probs_pad[:E])
        self.context_counts = (
            None
            if context_counts is None
            else _readonly(np.array(host_array(context_counts, np.int64)))
        )
        if self.context_counts is not None and self.context_counts.shape != (C,):
            raise ArtifactError(
                f"tri-gram context_counts has shape {self.context_counts.shape}, "
                f"the table has {C} contexts. Rebuild the table."
            )
        self.max_successors = int(np.diff(offsets).max()) if C else 0
        self.t = int(t) if t is not None else max(self.max_successors, 1)
        if self.t < self.max_successors:
            raise ArtifactError(
                f"tri-gram table says t={self.t} but a context has "
                f"{self.max_successors} successors. Rebuild the table."
            )
        self.min_count = int(min_count)
        self.stats = dict(stats or {})
        self._dense = None  # (ids int32 [C + 1, width], probs float32 [C + 1, width]) or False
        self._devices: dict = {}  # torch device -> the arrays there (see _on)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_csr(
        cls, context_keys, offsets, ids, probs, vocab_size: int, *, sort: bool = True, **kwargs
    ) -> TrigramTable:
        """A table from its four CSR arrays (numpy, lists or torch tensors).

        Args:
            context_keys, offsets, ids, probs: the module doc's layout.
            vocab_size: V.
            sort: order each context's successors by probability, descending (stable: equal
                probabilities keep their order), which the lookups assume. Sorted input is
                detected and kept as it is.
            **kwargs: ``t``, ``min_count``, ``context_counts``, ``stats`` (see the class doc).

        Raises:
            ArtifactError: arrays that disagree (lengths, offsets, unsorted or duplicate keys,
                ids outside ``[0, V)``, probabilities outside ``[0, 1]``).
        """
        keys, offsets = host_array(context_keys, np.int64), host_array(offsets, np.int64)
        ids, probs = host_array(ids), host_array(probs, np.float32)
        if sort and ids.size:
            _check_csr(keys, offsets, ids, probs, int(vocab_size))  # before the offsets are used
            seg = np.repeat(np.arange(keys.size), np.diff(offsets))  # [E] context of each entry
            if not ((np.diff(probs) <= 0) | (seg[1:] != seg[:-1])).all():
                order = np.lexsort((-probs, seg))
                ids, probs = ids[order], probs[order]
        return cls(keys, offsets, ids, probs, vocab_size, **kwargs)

    @classmethod
    def empty(cls, vocab_size: int, *, t: int = 12, min_count: int = 1) -> TrigramTable:
        """A table with no context: every lookup misses."""
        z = np.zeros(0, np.int64)
        return cls(
            z,
            np.zeros(1, np.int64),
            z,
            np.zeros(0, np.float32),
            vocab_size,
            t=t,
            min_count=min_count,
            context_counts=z,
        )

    # ------------------------------------------------------------------ lookups

    def successors(self, w1, w2, k: int | None = None):
        """Top-``k`` successors of each context ``(w1[i], w2[i])``: the one tri-gram lookup.

        Args:
            w1, w2: token ids of the same shape ``[...]``: numpy arrays (or lists) on the host, or
                torch tensors on any device. Negative ids, ids ``>= V`` and unseen contexts miss.
            k: columns (default :attr:`t`); more than a row holds are padded.

        Returns:
            ``(ids [..., k], probs [..., k])``, most probable first, ``-1`` / ``0`` where the
            context has fewer successors or never occurred: numpy int64 / float32 for numpy
            input, torch long / float32 on the input's device for torch input.
        """
        k = self.t if k is None else int(k)
        if k < 1:
            raise ConfigError(f"k={k}: ask for at least one successor.", param="k")
        if hasattr(w1, "device") and hasattr(w1, "detach"):  # torch in, torch out
            return self._successors_torch(w1, w2, k)
        w1, w2 = np.asarray(w1, np.int64), np.asarray(w2, np.int64)
        if w1.ndim == 0 or w2.ndim == 0:
            w1, w2 = np.atleast_1d(w1), np.atleast_1d(w2)
        # ADED's search calls this with 24-150 contexts, where each numpy call's overhead costs
        # more than its work: hence few calls, in place where possible.
        ctx = w1 * self.vocab_size + w2  # [...]; w1 outside [0, V) lands outside every key
        ctx[w2.view(np.uint64) >= self.vocab_size] = -1  # w2 < 0 or >= V would alias: no key is -1
        row = self._keys_pad.searchsorted(ctx)  # [...] in [0, C]
        row[self._keys_pad[row] != ctx] = self.context_keys.size  # misses read the empty row C
        dense = self._dense_rows()
        if dense is not None:
            width = dense[0].shape[1]
            if k < width:
                return dense[0][row, :k].astype(np.int64), dense[1][row, :k]
            ids, probs = dense[0][row].astype(np.int64), dense[1][row]  # [..., width]
            if k > width:  # more columns than any row holds: pad
                pad = ids.shape[:-1] + (k - width,)
                ids = np.concatenate([ids, np.full(pad, -1, np.int64)], -1)
                probs = np.concatenate([probs, np.zeros(pad, np.float32)], -1)
            return ids, probs
        start, end = self._off_pad[row], self._off_pad[row + 1]  # [...]; a miss: [E, E)
        idx = start[..., None] + np.arange(k)  # [..., k]
        idx[idx >= end[..., None]] = self.ids.size  # past the row's end: the (-1, 0) entry
        return self._ids_pad[idx], self._probs_pad[idx]

    def _successors_torch(self, w1, w2, k: int):
        """:meth:`successors` for torch tensors: the same steps with torch ops on their device."""
        import torch

        a = self._devices.get(w1.device) or self._on(w1.device)
        V, C, E = self.vocab_size, self.context_keys.size, self.ids.size
        if w1.dim() == 0:
            w1 = w1.reshape(1)
        w2 = torch.as_tensor(w2, device=w1.device).reshape(w1.shape).long()
        ctx = w1.long() * V + w2  # [...]
        ctx.masked_fill_(w2.div(V, rounding_mode="floor") != 0, -1)  # w2 outside [0, V): no key
        row = torch.searchsorted(a["keys_pad"], ctx)  # [...] in [0, C]
        row.masked_fill_(a["keys_pad"][row] != ctx, C)  # misses read the empty row C
        if "dense_ids" in a:
            width = a["dense_ids"].shape[1]
            flat = row.reshape(-1)
            ids = a["dense_ids"].index_select(0, flat).reshape(*row.shape, width)
            probs = a["dense_probs"].index_select(0, flat).reshape(*row.shape, width)
            if k < width:
                return ids[..., :k].long(), probs[..., :k]
            ids = ids.long()
            if k > width:
                pad = ids.shape[:-1] + (k - width,)
                ids = torch.cat([ids, ids.new_full(pad, -1)], -1)
                probs = torch.cat([probs, probs.new_zeros(pad)], -1)
            return ids, probs
        start, end = a["off_pad"][row], a["off_pad"][row + 1]
        idx = start[..., None] + torch.arange(k, device=row.device)
        idx.masked_fill_(idx >= end[..., None], E)
        return a["ids_pad"][idx], a["probs_pad"][idx]

    def prob(self, w1, w2, w3):
        """``P(w3 | w1, w2)`` per query (0 where the table lacks the tri-gram): shape of ``w1``.

        numpy in, numpy float32 out; torch in, torch float32 out.
        """
        ids, probs = self.successors(w1, w2, max(self.max_successors, 1))  # [..., m]
        if hasattr(ids, "device") and hasattr(ids, "detach"):
            import torch

            w3 = torch.as_tensor(w3, device=ids.device).long()
        else:
            w3 = np.asarray(w3, np.int64)
        hit = ids == w3[..., None]  # padding (-1) never matches a real id; its prob is 0 anyway
        return (probs * hit).sum(-1)

    # ------------------------------------------------------------------ storage

    def _dense_rows(self):
        """The table as padded rows ``ids int32 [C + 1, width]``, ``probs float32 [C + 1, width]``.

        Row ``C`` is all ``-1`` / ``0``. Made at the first lookup (a vectorised scatter); None
        when it would exceed :attr:`DENSE_MAX_BYTES`. int32 ids halve the copy; the lookup widens
        only the ``[N, k]`` rows it returns.
        """
        if self._dense is None:
            C, width = self.context_keys.size, max(self.max_successors, 1)
            if (C + 1) * width * 8 > self.DENSE_MAX_BYTES:
                self._dense = False
            else:
                lengths = np.diff(self.offsets)  # [C]
                row = np.repeat(np.arange(C), lengths)  # [E] context of each entry
                col = np.arange(self.ids.size) - self.offsets[:-1][row]  # rank within its row
                ids = np.full((C + 1, width), -1, np.int32)
                probs = np.zeros((C + 1, width), np.float32)
                ids[row, col] = self.ids
                probs[row, col] = self.probs
                self._dense = (ids, probs)  # private: only ever read
        return self._dense or None

    def _on(self, device) -> dict:
        """The lookup arrays as torch tensors on ``device`` (made once per device; on the CPU
        they share memory with the numpy arrays)."""
        import torch

        device = torch.empty(0, device=device).device  # 'cuda' -> 'cuda:0', the key lookups use
        if device not in self._devices:
            host = {
                "keys_pad": self._keys_pad,
                "off_pad": self._off_pad,
                "ids_pad": self._ids_pad,
                "probs_pad": self._probs_pad,
            }
            dense = self._dense_rows()
            if dense is not None:
                host.update(dense_ids=dense[0], dense_probs=dense[1])
            # on the CPU these share memory with the (private, writeable) numpy arrays
            self._devices[device] = {n: torch.from_numpy(a).to(device) for n, a in host.items()}
        return self._devices[device]

    def to(self, device) -> TrigramTable:
        """Prepare lookups of torch tensors on ``device`` now rather than at the first lookup.
        The numpy arrays stay on the host. Returns self."""
        self._on(device)
        return self

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The arrays as stored in ``trigram.safetensors``: ``context_keys`` int64, ``offsets``
        int64, ``ids`` int32, ``probs`` float16, and ``context_counts`` int64 when known."""
        out = {
            "context_keys": self.context_keys,
            "offsets": self.offsets,
            "ids": self.ids.astype(np.int32),
            "probs": self.probs.astype(np.float16),
        }
        if self.context_counts is not None:
            out["context_counts"] = self.context_counts
        return {n: np.ascontiguousarray(a) for n, a in out.items()}

    def __len__(self) -> int:
        """Number of contexts ``C``."""
        return int(self.context_keys.size)

    @property
    def num_entries(self) -> int:
        """Number of stored successors ``E``."""
        return int(self.ids.size)

    def nbytes(self) -> int:
        """Bytes of the arrays as stored on disk (:meth:`to_arrays`)."""
        return int(sum(a.nbytes for a in self.to_arrays().values()))

    def __repr__(self) -> str:
        return (
            f"TrigramTable(vocab_size={self.vocab_size}, contexts={len(self)}, "
            f"entries={self.num_entries}, t={self.t}, min_count={self.min_count})"
        )


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a``."""
    v = a.view()
    v.flags.writeable = False
    return v


def _check_csr(keys, offsets, ids, probs, V: int) -> None:
    """Raise :class:`ArtifactError` naming what is wrong with CSR arrays; O(E), vectorised."""

    def bad(what: str):
        return ArtifactError(
            f"tri-gram table arrays are inconsistent: {what}. Rebuild the table "
            f"(redraft-build-ngrams --kinds trigram --overwrite)."
        )

    if V < 1:
        raise ConfigError(f"vocab_size={V}: must be at least 1.", param="vocab_size")
    for name, a in (("context_keys", keys), ("offsets", offsets), ("ids", ids), ("probs", probs)):
        if a.ndim != 1:
            raise bad(f"{name} has shape {a.shape}, expected 1-D")
    C, E = keys.size, ids.size
    if offsets.size != C + 1:
        raise bad(f"{offsets.size} offsets for {C} contexts (want {C + 1})")
    if probs.size != E:
        raise bad(f"{E} ids but {probs.size} probs")
    if offsets[0] != 0 or offsets[-1] != E:
        raise bad(f"offsets run from {offsets[0]} to {offsets[-1]}, want 0 to {E}")
    if C and (np.diff(offsets) < 0).any():
        raise bad("offsets decrease")
    if C > 1 and not (np.diff(keys) > 0).all():
        raise bad("context keys are not strictly increasing")
    if C and (keys[0] < 0 or keys[-1] >= V * V):
        raise bad(f"context keys outside [0, {V}*{V})")
    if E and (ids.min() < 0 or ids.max() >= V):
        raise bad(f"successor ids outside [0, {V})")
    if E and not ((probs >= 0) & (probs <= 1)).all():  # NaN fails both comparisons
        raise bad("probabilities outside [0, 1] (or NaN)")


__all__ = ["ARRAY_NAMES", "TrigramTable", "host_array"]
