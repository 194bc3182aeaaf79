"""ADED (Liu et al. 2024) as a drafter: MCTS over the corpus tri-gram table, adapted per request.

Pieces, each usable alone:

* the corpus tri-gram table: :class:`redraft.ngrams.TrigramTable` (the n-gram stage's one type,
  CSR with a vectorised ``successors`` lookup); :func:`redraft.ngrams.as_trigram_table` takes it
  or loaded ``NGramTables``.
* :class:`TrigramOverlay`: ADED's adaptive updates (Adjust3Gram) for a batch of requests. After
  each step the tri-grams of the new output get their probability raised by ``increment`` up to
  ``cap``; tri-grams the table lacks enter with ``increment``. The overlay is a few sorted numpy
  arrays next to the table: the loaded table (and its file) never changes, and each request
  (batch row) sees only its own updates.
* :func:`redraft.infer.drafters.aded.mcts.mcts_search`: the draft maker (PUCT, expansion from the table,
  simulation by sampling it, backpropagation of the path score, candidates ranked by score).
* :class:`ADEDDrafter`: the three behind the decoder's :class:`~redraft.infer.drafters.Drafter`
  interface; its candidate paths join the shared verification tree.

Example::

    table = NGramTables.load("checkpoints/ngrams-sharegpt", target, kinds=["trigram"]).trigram
    drafter = ADEDDrafter(table)                # paper defaults: 150 iterations, depth 4, 24 paths
    decoder = SpeculativeDecoder(target, [drafter])
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from redraft.infer.drafters.aded.mcts import MCTSConfig, MCTSResult, mcts_search
from redraft.infer.spec.drafter import Draft, HostDrafter, HostFeedback
from redraft.infer.spec.paths import PAD
from redraft.ngrams import TrigramTable, as_trigram_table

# ADED's Adjust3Gram defaults: one observation of a tri-gram makes it a strong (not certain)
# candidate; repeats saturate at ``cap``.
DEFAULT_INCREMENT = 0.3
DEFAULT_CAP = 0.95


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

    def __init__(
        self,
        table: TrigramTable,
        batch_size: int,
        increment: float = DEFAULT_INCREMENT,
        cap: float = DEFAULT_CAP,
        patch_k: int = 16,
    ):
        self.table = table
        self.patch_k = patch_k  # lookups up to this k read precomputed merged rows
        self.increment, self.cap = float(increment), float(cap)
        V = table.vocab_size
        self._tri = V * V * V  # packed tri-grams per row
        if (batch_size + 1) * self._tri >= 2**62:
            raise ValueError(
                f"vocab {V} x batch {batch_size} does not pack into int64 keys; "
                f"decode in smaller batches"
            )
        self.batch_size = batch_size
        self.key = np.zeros(0, np.int64)
        self.prob_ = np.zeros(0, np.float32)

    def __len__(self) -> int:
        return int(self.key.size)

    def _pack(self, rows, w1, w2, w3=None) -> np.ndarray:
        V = self.table.vocab_size
        ctx = (
            np.asarray(rows, np.int64) * self._tri
            + (np.asarray(w1, np.int64) * V + np.asarray(w2, np.int64)) * V
        )
        return ctx if w3 is None else ctx + np.asarray(w3, np.int64)

    def update(self, rows, w1, w2, w3) -> None:
        """Observe tri-grams ``(w1, w2, w3)`` [n] of rows ``rows`` [n] (negative ids are skipped)."""
        rows, w1, w2, w3 = (np.asarray(a, np.int64).reshape(-1) for a in (rows, w1, w2, w3))
        ok = (w1 >= 0) & (w2 >= 0) & (w3 >= 0)
        if not ok.any():
            return
        rows, w1, w2, w3 = rows[ok], w1[ok], w2[ok], w3[ok]
        keys, first, reps = np.unique(
            self._pack(rows, w1, w2, w3), return_index=True, return_counts=True
        )
        pos = np.searchsorted(self.key, keys)
        present = pos < self.key.size
        present[present] = self.key[pos[present]] == keys[present]
        base = self.table.prob(w1[first], w2[first], w3[first])
        now = np.where(
            present,
            self.prob_[np.minimum(pos, max(self.key.size - 1, 0))] if self.key.size else 0.0,
            base,
        )
        new = np.maximum(now, np.minimum(self.cap, now + self.increment * reps)).astype(np.float32)
        self.prob_[pos[present]] = new[present]
        ins = ~present
        self.key = np.insert(self.key, pos[ins], keys[ins])
        self.prob_ = np.insert(self.prob_, pos[ins], new[ins])
        self._build_patch()

    def update_sequences(self, seqs: np.ndarray, first_row: int = 0) -> None:
        """Observe every tri-gram of ``seqs`` [n, T] (sequence ``i`` = request row
        ``first_row + i``, ``-1`` padded)."""
        seqs = np.asarray(seqs, np.int64)
        if seqs.shape[1] < 3:
            return
        rows = np.broadcast_to(
            first_row + np.arange(seqs.shape[0])[:, None], (seqs.shape[0], seqs.shape[1] - 2)
        )
        self.update(rows, seqs[:, :-2], seqs[:, 1:-1], seqs[:, 2:])

    def add_rows(self, n: int) -> None:
        """``n`` new request rows join after the current ones (with no updates yet)."""
        if (self.batch_size + n + 1) * self._tri >= 2**62:
            raise ValueError(
                f"vocab {self.table.vocab_size} x batch {self.batch_size + n} does not pack into "
                f"int64 keys; decode in smaller batches"
            )
        self.batch_size += n

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


class ADEDDrafter(HostDrafter):
    """ADED draft maker: MCTS over the tri-gram table with per-request adaptive updates.

    Args:
        table: the corpus tri-gram table (:class:`~redraft.ngrams.TrigramTable`, or loaded
            ``NGramTables`` holding one).
        iterations, c1, c2, depth, candidates, top_k, wave: MCTS settings (paper defaults; see
            :class:`~redraft.infer.mcts.MCTSConfig`).
        increment, cap: Adjust3Gram step and ceiling for tri-grams of the output.
        adapt: apply the adaptive updates at all (``False``: the static table).
        adapt_prompt: also seed each request's overlay with its prompt's tri-grams (the paper
            adapts to output only; prompts repeat names, code and phrases the answer reuses).
        seed: seed of the simulations' random generator (drafts are reproducible).
    """

    name = "aded"

    # the MCTS is numpy over the host's tokens: no device state, no device read (as a device
    # drafter it read its two context tokens back, uploaded its draft and read it back again,
    # and made the engine keep a device copy of every row: ~10 kernel launches a step)
    def __init__(
        self,
        table,
        iterations: int = 150,
        c1: float = 32.0,
        c2: float = 8.0,
        depth: int = 4,
        candidates: int = 24,
        top_k: int = 12,
        wave: int = 50,
        increment: float = DEFAULT_INCREMENT,
        cap: float = DEFAULT_CAP,
        adapt: bool = True,
        adapt_prompt: bool = True,
        complete: bool = True,
        seed: int = 0,
    ):
        self.table = as_trigram_table(table)
        self.cfg = MCTSConfig(
            iterations=iterations,
            c1=c1,
            c2=c2,
            depth=depth,
            candidates=candidates,
            top_k=top_k,
            wave=wave,
            complete=complete,
        )
        self.increment, self.cap = increment, cap
        self.adapt, self.adapt_prompt = adapt, adapt_prompt
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.overlay = TrigramOverlay(self.table, 1, increment, cap)
        self.stats = ADEDStats()
        self.last_result: MCTSResult | None = None

    def _lookup(self, rows, w1, w2, k):
        return self.overlay.successors(rows, w1, w2, k)

    def add_rows_host(self, host, start: int) -> None:
        if start == 0:  # a fresh batch: reproducible searches, fresh counters
            self.rng = np.random.default_rng(self.seed)
            self.overlay = TrigramOverlay(self.table, 0, self.increment, self.cap)
            self.stats = ADEDStats()
        self.overlay.add_rows(host.batch_size - start)
        if self.adapt and self.adapt_prompt:  # seed the new rows' overlays with their prompts
            seqs, plen = host.seqs[start:], host.prompt_lengths[start:]
            toks = np.full((len(seqs), max(int(n) for n in plen)), PAD, np.int64)
            for i, (seq, n) in enumerate(zip(seqs, plen)):
                toks[i, :n] = seq[:n]
            self.overlay.update_sequences(toks, first_row=start)

    @staticmethod
    def _before_last(host) -> np.ndarray:
        """``[B]`` each row's token before its last one (``PAD`` for a one-token row)."""
        return np.array([s[-2] if len(s) >= 2 else PAD for s in host.seqs], np.int64)

    def propose_host(self, host) -> Draft:
        """MCTS from the last two tokens of every row: ``Draft(tokens [B, C, D], logp)``."""
        t0, c0 = time.perf_counter(), time.process_time()
        B = host.batch_size
        w2 = np.asarray(host.last, np.int64)
        res = mcts_search(self._before_last(host), w2, self._lookup, self.cfg, self.rng)
        self.last_result = res
        self.stats.calls += 1
        self.stats.rows += B
        self.stats.nodes += res.num_nodes
        self.stats.seconds += time.perf_counter() - t0
        self.stats.cpu_seconds += time.process_time() - c0
        return Draft(tokens=res.tokens, logp=res.logp)

    def observe_host(self, host, draft: Draft, feedback: HostFeedback) -> None:
        """Adjust3Gram: raise the tri-grams the new tokens formed with the two before them."""
        if not self.adapt:
            return
        emitted = feedback.acceptance.emitted  # per row: the accepted tokens, then the bonus
        seq = np.full((host.batch_size, 2 + max(len(e) for e in emitted)), PAD, np.int64)
        seq[:, 0] = self._before_last(host)
        seq[:, 1] = host.last
        for b, e in enumerate(emitted):
            seq[b, 2 : 2 + len(e)] = e
        self.overlay.update_sequences(seq)

    def select_rows(self, keep: torch.Tensor) -> None:
        self.overlay.select_rows(keep.cpu().numpy())
