"""ADED (Liu et al. 2024) as a drafter: MCTS over the corpus tri-gram table, adapted per request.

Pieces, each usable alone:

* :class:`TrigramTable`: a read-only view of the tri-gram table in CSR form (sorted packed
  context keys ``w1 * V + w2``, offsets, successor ids, probabilities) with a vectorised
  ``successors`` lookup. :meth:`TrigramTable.from_csr` takes the four arrays, so tests and other
  tools can build one without the n-gram builder; :func:`as_trigram_table` adapts the builder's
  ``NGramTables``.
* :class:`TrigramOverlay`: ADED's adaptive updates (Adjust3Gram) for a batch of requests. After
  each step the tri-grams of the new output get their probability raised by ``increment`` up to
  ``cap``; tri-grams the table lacks enter with ``increment``. The overlay is a few sorted numpy
  arrays next to the table: the loaded table (and its file) never changes, and each request
  (batch row) sees only its own updates.
* :func:`redraft.infer.mcts.mcts_search`: the draft maker (PUCT, expansion from the table,
  simulation by sampling it, backpropagation of the path score, candidates ranked by score).
* :class:`ADEDDrafter`: the three behind the decoder's :class:`~redraft.infer.drafters.Drafter`
  interface; its candidate paths join the shared verification tree.

Example::

    table = as_trigram_table(NGramTables.load("checkpoints/ngrams-sharegpt", target))
    drafter = ADEDDrafter(table)                # paper defaults: 150 iterations, depth 4, 24 paths
    decoder = SpeculativeDecoder(target, [drafter])
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from redraft.errors import ArtifactError
from redraft.infer.drafters.base import PAD, DecodeState, Draft, Drafter, Feedback
from redraft.infer.mcts import MCTSConfig, MCTSResult, mcts_search

# ADED's Adjust3Gram defaults: one observation of a tri-gram makes it a strong (not certain)
# candidate; repeats saturate at ``cap``.
DEFAULT_INCREMENT = 0.3
DEFAULT_CAP = 0.95


class TrigramTable:
    """Read-only tri-gram table ``P(w3 | w1, w2)`` in CSR form, on the host (numpy).

    Attributes:
        keys: ``[C]`` int64, sorted: packed contexts ``w1 * V + w2``.
        offsets: ``[C + 1]`` int64: successors of ``keys[i]`` are ``ids[offsets[i]:offsets[i+1]]``.
        ids: ``[E]`` int64 successor ids, each context's sorted by probability (descending).
        probs: ``[E]`` float32 ``P(w3 | w1, w2)``.
        vocab_size: ``V`` of the packing.
    """

    def __init__(self, keys, offsets, ids, probs, vocab_size: int):
        self.keys = np.ascontiguousarray(keys, np.int64)
        self.offsets = np.ascontiguousarray(offsets, np.int64)
        self.ids = np.ascontiguousarray(ids, np.int64)
        self.probs = np.ascontiguousarray(probs, np.float32)
        self.vocab_size = int(vocab_size)
        C = self.keys.size
        if self.offsets.size != C + 1 or self.ids.size != self.probs.size or (
                C and self.offsets[-1] != self.ids.size):
            raise ArtifactError(
                f"tri-gram CSR arrays disagree: {C} keys, {self.offsets.size} offsets (want {C + 1}), "
                f"{self.ids.size} ids, {self.probs.size} probs, last offset "
                f"{self.offsets[-1] if self.offsets.size else None}. Rebuild the n-gram tables.")
        if C > 1 and not (np.diff(self.keys) > 0).all():
            raise ArtifactError("tri-gram context keys are not strictly increasing; rebuild the table.")
        lens = np.diff(self.offsets)
        self.max_successors = int(lens.max()) if C else 0
        # sentinel-padded copies for branch-free lookups: a miss maps to context C, whose range
        # [E, E) is empty, and entry E is (-1, 0)
        E = self.ids.size
        self._keys_pad = np.append(self.keys, np.iinfo(np.int64).max)  # stays sorted, never a context
        self._off_pad = np.append(self.offsets if C else np.zeros(1, np.int64), np.int64(E))
        self._ids_pad = np.append(self.ids, np.int64(-1))
        self._probs_pad = np.append(self.probs, np.float32(0.0))

    @classmethod
    def from_csr(cls, keys, offsets, ids, probs, vocab_size: int, sort: bool = True) -> "TrigramTable":
        """Build from CSR arrays (numpy or torch); ``sort`` orders each context's successors by
        probability (descending), which :meth:`successors` relies on."""
        arrs = [a.cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
                for a in (keys, offsets, ids, probs)]
        keys, offsets, ids, probs = arrs
        if sort and ids.size:
            seg = np.repeat(np.arange(keys.size), np.diff(offsets))
            p = probs.astype(np.float32)
            if not ((np.diff(p) <= 0) | (seg[1:] != seg[:-1])).all():  # not yet sorted per context
                order = np.lexsort((-p, seg))
                ids, probs = ids[order], probs[order]
        return cls(keys, offsets, ids, probs, vocab_size)

    @classmethod
    def from_trigrams(cls, w1, w2, w3, counts, vocab_size: int, top: int = 12) -> "TrigramTable":
        """Build from counted tri-grams (any order): ``P = C(w1,w2,w3) / C(w1,w2)``, top-``top``
        successors per context. For tests and small corpora (the builder does this at scale)."""
        w1, w2, w3 = (np.asarray(a, np.int64) for a in (w1, w2, w3))
        counts = np.asarray(counts, np.float64)
        ctx = w1 * vocab_size + w2
        order = np.lexsort((-counts, ctx))
        ctx, w3, counts = ctx[order], w3[order], counts[order]
        keys, start, n = np.unique(ctx, return_index=True, return_counts=True)
        total = np.add.reduceat(counts, start)
        rank = np.arange(ctx.size) - np.repeat(start, n)
        keep = rank < top
        probs = counts / np.repeat(total, n)
        kept = np.minimum(n, top)
        offsets = np.concatenate([[0], np.cumsum(kept)])
        return cls(keys, offsets, w3[keep], probs[keep].astype(np.float32), vocab_size)

    def __len__(self) -> int:
        return int(self.keys.size)

    def rows_of(self, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
        """Index of context ``(w1, w2)`` in :attr:`keys` per query ``[N]``, ``C`` (one past the
        last context, an empty range) if absent or if either token is negative."""
        w1, w2 = np.asarray(w1, np.int64), np.asarray(w2, np.int64)
        ctx = np.where((w1 | w2) < 0, -1, w1 * self.vocab_size + w2)
        pos = self._keys_pad.searchsorted(ctx)  # in [0, C]
        return np.where(self._keys_pad[pos] == ctx, pos, self.keys.size)

    def successors(self, w1: np.ndarray, w2: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` successors of each context: ``(ids [N, k] int64, probs [N, k] float32)``,
        ``-1`` / ``0`` padded, sorted by probability (descending)."""
        row = self.rows_of(w1, w2)
        start, end = self._off_pad[row], self._off_pad[row + 1]  # [N]; a miss: the empty [E, E)
        idx = start[:, None] + np.arange(k)  # [N, k]
        idx = np.where(idx < end[:, None], idx, self.ids.size)  # past the end -> the (-1, 0) entry
        return self._ids_pad[idx], self._probs_pad[idx]

    def prob(self, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray) -> np.ndarray:
        """``P(w3 | w1, w2)`` per query ``[N]`` (0 where the table lacks it)."""
        ids, probs = self.successors(w1, w2, max(self.max_successors, 1))
        hit = ids == np.asarray(w3, np.int64)[:, None]
        return (probs * hit).sum(1)


def as_trigram_table(tables, vocab_size: int | None = None) -> TrigramTable:
    """A :class:`TrigramTable` from what the n-gram builder gives.

    Accepts a :class:`TrigramTable`; a loaded ``redraft.ngrams.NGramTables`` holding the
    ``trigram`` kind; the builder's ``redraft.ngrams.trigrams.TrigramTable`` (``context_keys``,
    ``offsets``, ``ids``, ``probs``, ``vocab_size``); or any object with CSR arrays named
    ``keys/offsets/ids/probs``. The arrays are shared, not copied, when they are already numpy on
    the host and sorted.
    """
    if isinstance(tables, TrigramTable):
        return tables
    V = vocab_size or getattr(tables, "vocab_size", None)
    if "trigram" in getattr(tables, "kinds", ()) and hasattr(tables, "trigram_csr"):
        tg = tables.trigram_csr()
        return TrigramTable.from_csr(tg["context_keys"], tg["offsets"], tg["ids"], tg["probs"], int(V))
    for group in (("context_keys", "offsets", "ids", "probs"), ("keys", "offsets", "ids", "probs")):
        if all(getattr(tables, n, None) is not None for n in group):
            if V is None:
                raise ArtifactError("the tri-gram table does not say its vocab size; pass vocab_size=.")
            return TrigramTable.from_csr(*(getattr(tables, n) for n in group), vocab_size=int(V))
    where = getattr(tables, "path", None)
    raise ArtifactError(
        f"{where or type(tables).__name__} holds no tri-gram table (kinds: "
        f"{getattr(tables, 'kinds', '?')}). Build one with `redraft-build-ngrams --kinds trigram "
        f"--data default-chat --output-dir DIR` and pass that directory.")


class TrigramOverlay:
    """ADED's adaptive updates for a batch of requests, on top of a shared :class:`TrigramTable`.

    Boosted probabilities live in two sorted arrays: packed keys ``row * V^3 + (w1 * V + w2) * V
    + w3`` and the boosted ``P``. An update raises ``P`` of each new tri-gram to
    ``min(cap, P_now + increment * repeats)`` (never lowers it); a lookup merges the table's
    successors with the row's boosted ones (a boosted entry replaces the table's), re-sorts, and
    renormalises rows whose mass exceeds 1; the merged rows of every boosted context are
    precomputed after each update (``patch_k`` columns), so a lookup during the search is the
    table lookup plus one ``searchsorted``. Nothing is written to the table.
    """

    def __init__(self, table: TrigramTable, batch_size: int, increment: float = DEFAULT_INCREMENT,
                 cap: float = DEFAULT_CAP, patch_k: int = 16):
        self.table = table
        self.patch_k = patch_k  # lookups up to this k read precomputed merged rows
        self.increment, self.cap = float(increment), float(cap)
        V = table.vocab_size
        self._tri = V * V * V  # packed tri-grams per row
        if (batch_size + 1) * self._tri >= 2 ** 62:
            raise ValueError(f"vocab {V} x batch {batch_size} does not pack into int64 keys; "
                             f"decode in smaller batches")
        self.batch_size = batch_size
        self.key = np.zeros(0, np.int64)
        self.prob_ = np.zeros(0, np.float32)

    def __len__(self) -> int:
        return int(self.key.size)

    def _pack(self, rows, w1, w2, w3=None) -> np.ndarray:
        V = self.table.vocab_size
        ctx = np.asarray(rows, np.int64) * self._tri + (np.asarray(w1, np.int64) * V + np.asarray(w2, np.int64)) * V
        return ctx if w3 is None else ctx + np.asarray(w3, np.int64)

    def update(self, rows, w1, w2, w3) -> None:
        """Observe tri-grams ``(w1, w2, w3)`` [n] of rows ``rows`` [n] (negative ids are skipped)."""
        rows, w1, w2, w3 = (np.asarray(a, np.int64).reshape(-1) for a in (rows, w1, w2, w3))
        ok = (w1 >= 0) & (w2 >= 0) & (w3 >= 0)
        if not ok.any():
            return
        rows, w1, w2, w3 = rows[ok], w1[ok], w2[ok], w3[ok]
        keys, first, reps = np.unique(self._pack(rows, w1, w2, w3), return_index=True, return_counts=True)
        pos = np.searchsorted(self.key, keys)
        present = pos < self.key.size
        present[present] = self.key[pos[present]] == keys[present]
        base = self.table.prob(w1[first], w2[first], w3[first])
        now = np.where(present, self.prob_[np.minimum(pos, max(self.key.size - 1, 0))] if self.key.size else 0.0, base)
        new = np.maximum(now, np.minimum(self.cap, now + self.increment * reps)).astype(np.float32)
        self.prob_[pos[present]] = new[present]
        ins = ~present
        self.key = np.insert(self.key, pos[ins], keys[ins])
        self.prob_ = np.insert(self.prob_, pos[ins], new[ins])
        self._build_patch()

    def update_sequences(self, seqs: np.ndarray) -> None:
        """Observe every tri-gram of ``seqs`` [B, T] (row ``b`` = request row ``b``, ``-1`` padded)."""
        seqs = np.asarray(seqs, np.int64)
        if seqs.shape[1] < 3:
            return
        rows = np.broadcast_to(np.arange(seqs.shape[0])[:, None], (seqs.shape[0], seqs.shape[1] - 2))
        self.update(rows, seqs[:, :-2], seqs[:, 1:-1], seqs[:, 2:])

    def select_rows(self, keep) -> None:
        """Keep the updates of rows ``keep`` [B'] (renumbered 0..B'-1), drop the others."""
        keep = np.asarray(keep, np.int64)
        new_row = np.full(self.batch_size, -1, np.int64)
        new_row[keep] = np.arange(keep.size)
        row = self.key // self._tri
        nr = new_row[row]
        m = nr >= 0
        key = nr[m] * self._tri + self.key[m] % self._tri
        order = np.argsort(key, kind="stable")
        self.key, self.prob_ = key[order], self.prob_[m][order]
        self.batch_size = keep.size
        self._build_patch()

    def _merge(self, rows, w1, w2, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Table successors merged with the row's boosts (the slow path: sorts ``[N, 2k]``)."""
        ids, probs = self.table.successors(w1, w2, k)  # [N, k]
        if self.key.size == 0:
            return ids, probs
        w1, w2 = np.asarray(w1, np.int64), np.asarray(w2, np.int64)
        lo_key = self._pack(rows, w1, w2)
        lo = np.searchsorted(self.key, lo_key)
        hi = np.searchsorted(self.key, lo_key + self.table.vocab_size)
        at = np.nonzero((hi > lo) & (w1 >= 0) & (w2 >= 0))[0]  # queries with boosted entries
        if at.size == 0:
            return ids, probs
        idx = lo[at, None] + np.arange(k)[None, :]  # [n, k] overlay entries of each context
        ok = idx < hi[at, None]
        idx = np.minimum(idx, self.key.size - 1)
        o_ids = np.where(ok, self.key[idx] % self.table.vocab_size, -1)
        o_p = np.where(ok, self.prob_[idx], 0.0)
        b_ids, b_p = ids[at], probs[at]
        dup = (b_ids[:, :, None] == o_ids[:, None, :]) & ok[:, None, :]  # [n, k, k]
        b_p = np.where(dup.any(2), -1.0, b_p)  # table entries replaced by boosts drop out
        all_ids = np.concatenate([b_ids, o_ids], 1)  # [n, 2k]
        all_p = np.concatenate([b_p, o_p], 1)
        top = np.argsort(-all_p, axis=1, kind="stable")[:, :k]
        m_ids = np.take_along_axis(all_ids, top, 1)
        m_p = np.take_along_axis(all_p, top, 1)
        valid = (m_p > 0) & (m_ids >= 0)
        m_ids, m_p = np.where(valid, m_ids, -1), np.where(valid, m_p, 0.0)
        mass = m_p.sum(1, keepdims=True)
        m_p = np.where(mass > 1.0, m_p / np.maximum(mass, 1e-12), m_p)
        ids, probs = ids.copy(), probs.copy()
        ids[at], probs[at] = m_ids, m_p.astype(np.float32)
        return ids, probs

    def _build_patch(self) -> None:
        """Merged successor rows of every boosted context, so lookups need no sort."""
        ctx = np.unique(self.key // self.table.vocab_size)  # [M] packed (row, w1, w2)
        row, rest = np.divmod(ctx, self._tri // self.table.vocab_size)
        w1, w2 = np.divmod(rest, self.table.vocab_size)
        ids, probs = self._merge(row, w1, w2, self.patch_k)  # [M, patch_k]
        self._patch_key = np.append(ctx * self.table.vocab_size, np.iinfo(np.int64).max)  # as _pack
        self._patch_ids, self._patch_probs = ids, probs

    def successors(self, rows, w1, w2, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` successors per row and context, table merged with this row's boosts:
        ``(ids [N, k] int64, probs [N, k] float32)``, ``-1`` / ``0`` padded, sorted descending."""
        if k > self.patch_k:
            return self._merge(rows, w1, w2, k)
        ids, probs = self.table.successors(w1, w2, k)  # [N, k]
        if self.key.size == 0:
            return ids, probs
        q = self._pack(rows, w1, w2)
        pos = self._patch_key.searchsorted(q)
        hit = np.nonzero((self._patch_key[pos] == q) & ((np.asarray(w1) | np.asarray(w2)) >= 0))[0]
        if hit.size:
            ids[hit] = self._patch_ids[pos[hit], :k]
            probs[hit] = self._patch_probs[pos[hit], :k]
        return ids, probs


@dataclass
class ADEDStats:
    """Per-batch counters: MCTS calls, rows searched, and seconds spent searching."""

    calls: int = 0
    rows: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # process CPU time: robust to other processes on a shared machine
    nodes: int = 0

    @property
    def ms_per_step(self) -> float:
        return 1000.0 * self.seconds / max(self.calls, 1)

    @property
    def cpu_ms_per_step(self) -> float:
        return 1000.0 * self.cpu_seconds / max(self.calls, 1)


class ADEDDrafter(Drafter):
    """ADED draft maker: MCTS over the tri-gram table with per-request adaptive updates.

    Args:
        table: the corpus tri-gram table (:class:`TrigramTable`, or what :func:`as_trigram_table`
            accepts).
        iterations, c1, c2, depth, candidates, top_k, wave: MCTS settings (paper defaults; see
            :class:`~redraft.infer.mcts.MCTSConfig`).
        increment, cap: Adjust3Gram step and ceiling for tri-grams of the output.
        adapt: apply the adaptive updates at all (``False``: the static table).
        adapt_prompt: also seed each request's overlay with its prompt's tri-grams (the paper
            adapts to output only; prompts repeat names, code and phrases the answer reuses).
        seed: seed of the simulations' random generator (drafts are reproducible).
    """

    name = "aded"

    def __init__(self, table, iterations: int = 150, c1: float = 32.0, c2: float = 8.0,
                 depth: int = 4, candidates: int = 24, top_k: int = 12, wave: int = 50,
                 increment: float = DEFAULT_INCREMENT, cap: float = DEFAULT_CAP, adapt: bool = True,
                 adapt_prompt: bool = True, complete: bool = True, seed: int = 0):
        self.table = as_trigram_table(table)
        self.cfg = MCTSConfig(iterations=iterations, c1=c1, c2=c2, depth=depth,
                              candidates=candidates, top_k=top_k, wave=wave, complete=complete)
        self.increment, self.cap = increment, cap
        self.adapt, self.adapt_prompt = adapt, adapt_prompt
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.overlay = TrigramOverlay(self.table, 1, increment, cap)
        self.stats = ADEDStats()
        self.last_result: MCTSResult | None = None

    def _lookup(self, rows, w1, w2, k):
        return self.overlay.successors(rows, w1, w2, k)

    def begin(self, state: DecodeState) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.overlay = TrigramOverlay(self.table, state.batch_size, self.increment, self.cap)
        self.stats = ADEDStats()
        if self.adapt and self.adapt_prompt:
            toks = state.tokens.cpu().numpy()
            T = toks.shape[1]
            plen = state.prompt_lengths.cpu().numpy()
            toks = np.where(np.arange(T)[None, :] < plen[:, None], toks, PAD)
            self.overlay.update_sequences(toks)

    def propose(self, state: DecodeState) -> Draft:
        """MCTS from the last two tokens of every row: ``Draft(tokens [B, C, D], logp)``."""
        t0, c0 = time.perf_counter(), time.process_time()
        toks = state.tokens
        lengths = state.lengths
        B = toks.shape[0]
        ar = torch.arange(B, device=toks.device)
        w2 = state.last
        w1 = torch.where(lengths >= 2, toks[ar, (lengths - 2).clamp(min=0)], torch.full_like(w2, PAD))
        res = mcts_search(w1.cpu().numpy(), w2.cpu().numpy(), self._lookup, self.cfg, self.rng)
        self.last_result = res
        self.stats.calls += 1
        self.stats.rows += B
        self.stats.nodes += res.num_nodes
        self.stats.seconds += time.perf_counter() - t0
        self.stats.cpu_seconds += time.process_time() - c0
        dev = state.device
        return Draft(tokens=torch.from_numpy(res.tokens).to(dev),
                     logp=torch.from_numpy(res.logp).to(dev))

    def observe(self, state: DecodeState, draft: Draft, feedback: Feedback) -> None:
        """Adjust3Gram: raise the tri-grams the new tokens formed with the two before them."""
        if not self.adapt:
            return
        toks, lengths = state.tokens, state.lengths
        B = toks.shape[0]
        ar = torch.arange(B, device=toks.device)
        w1 = torch.where(lengths >= 2, toks[ar, (lengths - 2).clamp(min=0)], torch.full_like(state.last, PAD))
        A = feedback.accepted.shape[1]
        acc = feedback.accepted.masked_fill(
            torch.arange(A, device=toks.device)[None, :] >= feedback.num_accepted[:, None], PAD)
        # [B, 2 + A + 1]: w1, y, accepted..., bonus; the bonus moves left over the padding
        seq = torch.cat([w1[:, None], state.last[:, None], acc, torch.full_like(state.last[:, None], PAD)], 1)
        seq[ar, 2 + feedback.num_accepted] = feedback.bonus
        self.overlay.update_sequences(seq.cpu().numpy())

    def select_rows(self, keep: torch.Tensor) -> None:
        self.overlay.select_rows(keep.cpu().numpy())


# ---------------------------------------------------------------------------------- corpus tables


def trigram_table_from_docs(docs, vocab_size: int, top: int = 12) -> TrigramTable:
    """Count the tri-grams inside each token sequence of ``docs`` (never across two documents)
    and keep the top-``top`` successors per context. Vectorised: one ``np.unique`` over packed
    keys. A stand-in for the n-gram builder (``redraft-build-ngrams``) when no table is built."""
    parts = []
    for d in docs:
        d = np.asarray(d, np.int64)
        if d.size >= 3:
            parts.append(d)
            parts.append(np.full(2, -1, np.int64))  # two separators: no window spans two docs
    if not parts:
        return TrigramTable(np.zeros(0), np.zeros(1), np.zeros(0), np.zeros(0), vocab_size)
    s = np.concatenate(parts)
    a, b, c = s[:-2], s[1:-1], s[2:]
    ok = (a >= 0) & (b >= 0) & (c >= 0)
    V = vocab_size
    keys, counts = np.unique(((a[ok] * V + b[ok]) * V + c[ok]), return_counts=True)
    return TrigramTable.from_trigrams(keys // (V * V), (keys // V) % V, keys % V, counts, V, top)


def corpus_docs(kind: str, tokenizer, max_docs: int = 20000, max_chars: int = 200_000_000):
    """Token ids of the default corpora, as documents (list of int lists).

    ``kind="chat"``: the training split of the default ShareGPT data (held-out conversations are
    skipped: benchmark prompts come from them), each conversation rendered with the target's chat
    template; ``kind="code"``: the Python standard library's ``.py`` files.
    """
    from redraft.data.records import DataStats, is_heldout
    from redraft.data.sources import default_code_dir, iter_records

    texts, total = [], 0
    if kind == "chat":
        for r in iter_records("default-chat", stats=DataStats()):
            if r.kind != "chat" or is_heldout(r.id, 0.02):
                continue
            try:
                t = tokenizer.apply_chat_template(r.messages, tokenize=False)
            except Exception:  # a template that rejects this conversation: plain text instead
                t = "\n".join(m["content"] for m in r.messages)
            texts.append(t)
            total += len(t)
            if len(texts) >= max_docs or total >= max_chars:
                break
    elif kind == "code":
        for f in sorted(default_code_dir().rglob("*.py")):
            if "site-packages" in f.parts or "test" in f.parts or "tests" in f.parts:
                continue
            try:
                t = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            texts.append(t)
            total += len(t)
            if len(texts) >= max_docs or total >= max_chars:
                break
    else:
        raise ValueError(f"corpus kind {kind!r}: use 'chat' or 'code'")
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return enc


class DraftRetrieverDrafter(Drafter):
    """REST / ADED's published retriever (``draftretriever`` on PyPI) as a drafter: the longest
    suffix of the row (``max_q`` down to ``min_q`` tokens) found in the corpus index proposes the
    continuations the index returns (``choices`` tree nodes at most, REST's default 64).

    Build the index with :func:`build_retriever_index` from the same token documents as the
    tri-gram table, so both methods see the same corpus.
    """

    name = "draftretriever"

    def __init__(self, index_path, choices: int = 64, max_q: int = 16, min_q: int = 2, depth: int = 8):
        import draftretriever

        self.reader = draftretriever.Reader(str(index_path))
        self.choices, self.max_q, self.min_q, self.depth = choices, max_q, min_q, depth

    def propose(self, state: DecodeState) -> Draft:
        toks, lens = state.tokens.tolist(), state.lengths.tolist()
        rows = []
        for r in range(len(toks)):
            seq, found = toks[r][: lens[r]], []
            for q in range(min(self.max_q, len(seq)), self.min_q - 1, -1):
                out = self.reader.search(seq[-q:], choices=self.choices)
                if out[0]:
                    found = [[t if t >= 0 else PAD for t in path[: self.depth]] for path in out[0]]
                    break
            rows.append(found)
        P = max(1, max(len(f) for f in rows))
        L = max([len(p) for f in rows for p in f] + [1])
        out = torch.full((len(rows), P, L), PAD, dtype=torch.long)
        for r, f in enumerate(rows):
            for i, p in enumerate(f):
                out[r, i, : len(p)] = torch.tensor(p, dtype=torch.long)
        return Draft(tokens=out.to(state.device))


def build_retriever_index(docs, path, vocab_size: int) -> str:
    """Write a ``draftretriever`` index of the token documents ``docs`` to ``path``."""
    import draftretriever

    w = draftretriever.Writer(str(path), vocab_size=vocab_size)
    for d in docs:
        if len(d):
            w.add_entry([int(t) for t in d])
    w.finalize()
    return str(path)


# ---------------------------------------------------------------------------------- benchmark


def bench_methods(target=None, table=None, mix=()):
    """Methods this module adds to ``redraft-bench``: ``{name: [drafters]}``.

    ``table``: the loaded n-gram tables (or a :class:`TrigramTable`); nothing is added when they
    hold no tri-gram kind. ``mix``: the drafters of the unified mix; ADED joins them as
    ``"mix+aded"``.
    """
    if table is None:
        return {}
    try:
        tri = as_trigram_table(table)
    except ArtifactError:
        return {}
    out = {"aded": [ADEDDrafter(tri)]}
    if mix:
        out["mix+aded"] = list(mix) + [ADEDDrafter(tri)]
    return out


def _load_or_build_corpus(kind: str, target, max_docs: int, cache_dir):
    """Token documents of corpus ``kind``, cached as ``.npy`` (flat ids + offsets) under ``cache_dir``."""
    from pathlib import Path

    cache = Path(cache_dir) / f"{kind}-{max_docs}-{target.fingerprint.replace(':', '_')}"
    if (cache / "offsets.npy").is_file():
        flat, off = np.load(cache / "ids.npy"), np.load(cache / "offsets.npy")
        return [flat[off[i]:off[i + 1]] for i in range(off.size - 1)]
    docs = corpus_docs(kind, target.tokenizer, max_docs=max_docs)
    off = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    flat = np.concatenate([np.asarray(d, np.int32) for d in docs]) if docs else np.zeros(0, np.int32)
    tmp = cache.with_name(cache.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "ids.npy", flat)
    np.save(tmp / "offsets.npy", off)
    import os
    import shutil
    shutil.rmtree(cache, ignore_errors=True)
    os.replace(tmp, cache)
    return [flat[off[i]:off[i + 1]] for i in range(off.size - 1)]


def main(argv=None) -> int:
    """``python -m redraft.infer.aded``: ADED vs draftretriever (same corpus), HSDDW vs greedy,
    each alone and added to the mix, in one run on the default target. Prints a Markdown table
    and writes JSON."""
    import argparse
    import json
    import os
    import sys
    from pathlib import Path

    from redraft.errors import RedraftError

    ap = argparse.ArgumentParser(prog="python -m redraft.infer.aded", description=main.__doc__)
    ap.add_argument("--target", default="default", help="target spec (load_target); default SmolLM2-135M")
    ap.add_argument("--dtype", default="float32", help="target dtype: float32 or bfloat16")
    ap.add_argument("--datasets", default="chat,code", help="comma list: chat (held-out ShareGPT) and/or code (HumanEval)")
    ap.add_argument("--prompts", type=int, default=10, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--methods", default="greedy,aded,draftretriever,context,context+aded,hsddw,context+hsddw",
                    help="comma list of methods; '+' joins drafters into one decoder. Parts: greedy, "
                         "aded, aded-static, draftretriever, context, hsddw, hsddw-m1, hsddw-tri")
    ap.add_argument("--corpus-docs", type=int, default=20000, help="documents of the corpus for the tables/index")
    ap.add_argument("--table", default=None, help="an n-gram tables directory (redraft-build-ngrams) to use "
                                                  "instead of counting the corpus here (applies to every dataset)")
    ap.add_argument("--ee-layers", default="4,12", help="early-exit layers of HSDDW's M1,M2 (one number: M1 only)")
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="early-exit draft heads score only the N most frequent corpus tokens (0: all)")
    ap.add_argument("--cache-dir", default="checkpoints/bench-aded", help="where corpus tokens and indexes are cached")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (0: torch's default). On a shared, oversubscribed CPU "
                         "use 1: spinning thread pools make every forward many times slower")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        import torch as _torch

        _torch.set_num_threads(args.threads)
    try:
        return _bench(args)
    except RedraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _bench(args) -> int:
    import json
    from pathlib import Path

    from redraft.data.prompts import heldout_prompts, humaneval_prompts
    from redraft.infer.decoder import SpeculativeDecoder
    from redraft.infer.drafters.ngram import ContextNGramDrafter
    from redraft.infer.hsddw import (CausalLMModel, HSDDWDrafter, TrigramModel, default_hierarchy,
                                     early_exit_model, frequent_tokens)
    from redraft.models.target import load_target

    target = load_target(args.target, dtype=args.dtype, device="cpu")
    V = target.vocab_size
    cache_dir = Path(args.cache_dir)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    ee = [int(x) for x in args.ee_layers.split(",")]
    results = {}
    curve = None
    for ds in [d.strip() for d in args.datasets.split(",")]:
        prompts = heldout_prompts(n=args.prompts) if ds == "chat" else humaneval_prompts(args.prompts)
        t0 = time.perf_counter()
        if args.table:
            from redraft.ngrams import NGramTables

            table = as_trigram_table(NGramTables.load(args.table, target))
            docs = None
        else:
            docs = _load_or_build_corpus(ds, target, args.corpus_docs, cache_dir)
            table = trigram_table_from_docs(docs, V)
        idx = cache_dir / f"{ds}-{args.corpus_docs}.idx"
        if any("draftretriever" in m for m in methods) and not idx.is_file():
            if docs is None:
                docs = _load_or_build_corpus(ds, target, args.corpus_docs, cache_dir)
            build_retriever_index(docs, idx, V)
        subset = frequent_tokens(docs, V, args.draft_vocab) if docs is not None and args.draft_vocab else None
        print(f"[{ds}] {len(prompts)} prompts; tri-gram table {len(table)} contexts "
              f"({time.perf_counter() - t0:.1f}s to load/build)", flush=True)

        def drafters(name):
            parts = []
            for part in name.split("+"):
                if part == "greedy":
                    continue
                if part == "aded":
                    parts.append(ADEDDrafter(table))
                elif part == "aded-static":
                    parts.append(ADEDDrafter(table, adapt=False))
                elif part == "draftretriever":
                    parts.append(DraftRetrieverDrafter(idx))
                elif part == "context":
                    parts.append(ContextNGramDrafter(V))
                elif part == "hsddw":  # early-exit(M1) -> early-exit(M2) -> target
                    parts.append(default_hierarchy(target, ee[0], ee[1] if len(ee) > 1 else 10 ** 6,
                                                   vocab_subset=subset))
                elif part == "hsddw-m1":  # early-exit M1 with self-verify alone
                    parts.append(default_hierarchy(target, ee[0], 10 ** 6, vocab_subset=subset))
                elif part == "hsddw-tri":  # tri-gram table (M1) -> early-exit (M2) -> target
                    m2 = CausalLMModel(early_exit_model(target.model, ee[-1]), f"ee{ee[-1]}", V, subset)
                    parts.append(HSDDWDrafter(TrigramModel(table, V), m2, name="hsddw-tri"))
                else:
                    raise ValueError(f"unknown method part {part!r}")
            return parts

        ref = None
        for m in methods:
            ds_list = drafters(m)
            dec = SpeculativeDecoder(target, ds_list, budget="auto" if ds_list else 0, cost_curve=curve)
            if ds_list and curve is None:
                curve = dec.measure_cost()
            new = calls = 0
            t, cpu = time.perf_counter(), time.process_time()
            outs = []
            for p in prompts:
                g = dec.generate(p, max_new_tokens=args.max_new_tokens)[0]
                outs.append(g.tokens)
                new += g.stats.new_tokens
                calls += g.stats.target_calls
            dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
            if m == "greedy":
                ref = outs
            row = {"tokens_per_s": new / dt, "tokens_per_cpu_s": new / max(dcpu, 1e-9),
                   "tokens_per_call": new / max(calls, 1), "new_tokens": new, "seconds": dt, "cpu_seconds": dcpu, "identical_to_ar": None if ref is None else sum(a == b for a, b in zip(outs, ref)) / len(ref)}
            for d in ds_list:
                if isinstance(d, ADEDDrafter):
                    row["mcts_ms_per_step"] = d.stats.ms_per_step
                    row["mcts_cpu_ms_per_step"] = d.stats.cpu_ms_per_step
                if isinstance(d, HSDDWDrafter):
                    row["hsddw"] = d.stats.to_dict()
            results.setdefault(ds, {})[m] = row
            base = results[ds].get("greedy", {})
            row["speedup_vs_ar"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
            row["cpu_speedup_vs_ar"] = row["tokens_per_cpu_s"] / base["tokens_per_cpu_s"] if base else None
            print(f"[{ds}] {m:24s} tau {row['tokens_per_call']:.2f}  {row['tokens_per_s']:.2f} tok/s  "
                  f"x{row['speedup_vs_ar'] or 0:.2f}  cpu x{row['cpu_speedup_vs_ar'] or 0:.2f}  "
                  f"identical {row['identical_to_ar']}"
                  + (f"  mcts {row['mcts_ms_per_step']:.2f} ms/step ({row['mcts_cpu_ms_per_step']:.2f} CPU)"
                     if 'mcts_ms_per_step' in row else ""),
                  flush=True)
    print("\n| dataset | method | tau (tokens/call) | tokens/s (wall) | speedup (wall) | speedup (CPU time) "
          "| identical to greedy | MCTS CPU ms/step |")
    print("|---|---|---|---|---|---|---|---|")
    for ds, rows in results.items():
        for m, r in rows.items():
            mc = f"{r['mcts_cpu_ms_per_step']:.2f}" if "mcts_ms_per_step" in r else ""
            print(f"| {ds} | {m} | {r['tokens_per_call']:.2f} | {r['tokens_per_s']:.2f} | "
                  f"{(r['speedup_vs_ar'] or 0):.2f} | {(r['cpu_speedup_vs_ar'] or 0):.2f} | "
                  f"{r['identical_to_ar']} | {mc} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
