"""The prefill queue: which prompt tokens go into which forward, and when a request joins.

Requests wait (``waiting``) until the next step admits them to the prefill queue
(``prefilling``, shortest remaining prompt first); each step gives the queue's first rows one
piece of prompt (:meth:`PrefillScheduler._prefill_piece`), in a forward of its own or riding in
the running rows' verify forward (``DecoderConfig.fuse_prefill``); a row whose whole prompt is in
the cache samples its first token and joins the batch (``Engine._join``). How large a piece may
be is the pacer's answer (:mod:`redraft.infer.engine.pacer`); where a piece goes in the cache
(the slots right after the batch, or a parked slot above every slot the batch may take) is
decided here.

:class:`PrefillScheduler` is the engine's prefill half: :class:`~redraft.infer.engine.engine.Engine`
inherits it, and its methods read the engine's rows, cache, verifier and speculator.
"""

from __future__ import annotations

import time

import torch

from redraft.infer.engine.pacer import (
    PREFILL_CHUNK_MAX,
    PREFILL_CHUNK_MIN,
    PrefillPacer,
    prefill_chunk,
)
from redraft.infer.engine.rows import Row
from redraft.infer.runner.cost import curve_np
from redraft.infer.stats import StreamEvent

MAX_PADDING = 0.5  # prompts share a prefill forward while its padding stays below this share
IDLE_STEPS = 8  # while nobody decodes, a step's prefill may cost this many reference steps


class PrefillScheduler:
    """The prefill queue of an engine (see the module doc)."""

    def _init_queue(self, config) -> None:
        self.prefilling: list[Row] = []  # being prefilled, in the slots after the active rows
        self.waiting: list[Row] = []
        # the running rows' last verify forward (batch x tree tokens) and the last prefill
        # forward's (tokens, span, clock marks): what the "auto" prefill chunk is paced by
        self._step_tokens = 0
        self._chunk_marks = None
        self._pacer = PrefillPacer(config.prefill_share)
        self._oldest_turn = False  # the next prefill piece goes to the oldest request

    def _reserve(self, new: list[Row]) -> None:
        """A cache with room for the running rows, those being prefilled (and a parked slot
        each) and ``new`` (made once, grown by doubling). The columns ``new`` will need are
        added at a row's first piece (:meth:`_plan_piece`; on a CPU a grown buffer's pages are
        zeroed only as they are touched: :func:`~redraft.infer.runner.kv.zeroed`)."""
        width = self._width(new)
        if self.cache is None:
            self.cache = self.verifier.new_cache(len(new) + 1, width)  # + 1: a parked slot
            return
        # rows now (parking one of them then grows nothing); columns when a piece needs them
        self.cache.reserve(
            self._slots_needed(len(new), park=1), self.cache.capacity, self._used_columns
        )

    def _used_columns(self) -> dict[int, int]:
        """Slot -> columns holding data, between steps: each batch row's cached tokens and each
        parked row's pieces so far (a growing cache copies only these)."""
        c = self.cache
        used = dict(enumerate(c.host_lengths[: c.batch]))
        for r in self.prefilling:
            if r.slot is not None:
                used[r.slot] = r.filled
        return used

    def _width(self, rows: list[Row]) -> int:
        """Columns ``rows`` need to decode to their end (and the running rows theirs)."""
        slack = self.config.max_nodes + 2 if self.speculator.drafters else 2
        width = max(len(r.prompt) + r.params.max_new_tokens for r in rows) + slack + 1
        return max(
            [width]
            + [r.length + r.params.max_new_tokens - len(r.tokens) + slack + 1 for r in self.rows]
        )

    def _slots_needed(self, new: int = 0, park: int = 0) -> int:
        """Slots for the batch, the prefill queue with ``new`` more rows (any of them may join
        next: their slots follow the batch's) and the parked rows, with ``park`` more."""
        parked = sum(r.slot is not None for r in self.prefilling)
        return self.cache.batch + len(self.prefilling) + new + parked + park

    def _admit(self, new: list[Row]) -> None:
        """Waiting rows ``new`` join the prefill queue (no slot yet: a row gets one when its
        first piece is written, see :meth:`_prefill_piece`)."""
        self._reserve(new)
        t0 = time.perf_counter()
        for r in new:
            r.t_start = t0
        self.prefilling += new
        self._repark()
        if self.prefix is not None:
            for r in new:
                self._reuse_prefix(r)

    def _reuse_prefix(self, row: Row) -> None:
        """The longest stored prefix of ``row``'s prompt (all but its last token at most) counts
        as prefilled: its entries are copied into the row's slot with its first piece
        (:meth:`_plan_piece`; straight into the batch's slots when that piece finishes it)."""
        m, blocks = self.prefix.match(row.prompt, len(row.prompt) - 1)
        if m:
            row.filled = row.stats.cached_tokens = m
            row.reused = blocks

    def _park(self, row: Row) -> int:
        """A slot for ``row``, whose prompt is prefilled in several pieces: the highest free one,
        above every slot the batch and the rows joining it may take (so neither a row leaving
        nor a request arriving moves a long prompt's cache; it is copied once, when it joins)."""
        cache = self.cache
        if cache.reserve(self._slots_needed(park=1), cache.capacity, self._used_columns):
            self._repark()
        row.slot = self._free_slot()
        return row.slot

    def _free_slot(self) -> int:
        """The highest slot no parked row holds."""
        used = {r.slot for r in self.prefilling}
        return max(t for t in range(self.cache.slots) if t not in used)

    def _repark(self) -> None:
        """Parked rows below the slots the batch and the prefill queue may take move up (after
        the queue grew, or the cache did: rare)."""
        low = self.cache.batch + len(self.prefilling)
        for r in self.prefilling:
            if r.slot is not None and r.slot < low:
                free = self._free_slot()
                self.cache.move_row(r.slot, free, r.filled)
                r.slot = free

    def _prefill(self) -> list[StreamEvent]:
        """Prefill forwards: waiting requests join the prefill queue; its first rows get their
        next piece of prompt in one forward (:meth:`_prefill_piece`); those whose whole prompt
        is now in the cache sample their first token and join the batch (:meth:`_join`). One
        forward when rows decode (it delays them); while nobody decodes, under "auto", forwards
        of up to
        ``PREFILL_CHUNK_MAX`` tokens until every waiting prompt is in, except that pieces of
        long prompts stop once prompts have joined (they decode, the long prompts' pieces
        riding with them) or after ``IDLE_STEPS`` reference steps (a batch of prompts joins
        together, but a request that arrives meanwhile is not held back long by a long prompt);
        with chunking off, every waiting prompt. With :attr:`whole_prompts` (``generate()``:
        the caller waits for the whole batch) an idle burst prefills every waiting prompt."""
        if self.waiting:
            new, self.waiting = self.waiting, []
            self._admit(new)
        fits = self._chunk_limit()
        chunk = self.config.prefill_chunk
        off, idle = chunk == 0, chunk == "auto" and not self.rows
        t0, ref = time.perf_counter(), self._pacer.ref
        events = self._prefill_piece(fits)
        while self.prefilling and (off or idle):
            # (shortest first: once a piece is cut, only long prompts are left; a prefix from
            # the prefix cache is not a cut piece: a burst of chats sharing a system prompt
            # otherwise stopped after its first forward, the rest riding with the few that
            # joined, 110 forwards for 16 chats of 64 tokens where 64 do)
            head = self.prefilling[0]
            cut = head.filled > head.stats.cached_tokens and not self.whole_prompts
            if idle and cut and self.rows:
                # only long prompts are left and prompts joined: they decode now, the long
                # ones' pieces riding with them (one round of 4 streams through HTTP: a server
                # that found all four prompts waiting prefilled the short ones, then the long
                # one's pieces for 8 reference steps before the short ones' first tokens, TTFT
                # p50 1.4-1.8 s against 0.5 s where they had arrived one step apart)
                break
            if idle and cut and ref is not None and time.perf_counter() - t0 >= IDLE_STEPS * ref:
                break
            if idle and self.speculator.cost_curve is not None and self._chunk_timed():
                # each piece paced by every piece timed before it, not by the step's first
                # limit (only the step's last piece used to be timed: a 40-token prompt's pieces
                # stayed at 16 tokens, 3 forwards, however often it came)
                self._observe_chunk()
                fits = self._idle_fits()
            events += self._prefill_piece(fits)
        return events

    def _chunk_timed(self) -> bool:
        """Whether the last prefill forward's time can be read without waiting (always on a
        CPU; on CUDA once its end event is done: no sync inside a run of pieces)."""
        marks = self._chunk_marks
        return marks is not None and (not self._clock.cuda or marks[3].query())

    def _prefill_piece(self, fits) -> list[StreamEvent]:
        """One prefill forward of the queue's first rows (:meth:`_chunk_rows`), the queue in
        order of remaining prompt tokens (shortest first: a short request does not wait for a
        long prompt's pieces), except that while rows decode every other piece goes to the
        oldest request (a long prompt is not starved by a stream of short ones). Rows that this
        forward finishes are written straight into the slots after the batch (a row prefilled in
        earlier pieces is copied there first, once); a piece of a longer prompt goes to that
        row's parked slot (:meth:`_park`)."""
        t0 = time.perf_counter()
        rows, T, first, starts = self._plan_piece(fits)
        m0 = self._clock.mark()
        h_last = self.verifier.prefill(
            [r.prompt[r.filled : r.filled + T] for r in rows],
            self.cache,
            first_slot=first,
            starts=starts,
        )  # [n, H]
        # timed at the next chunk (on CUDA the events are done by then: every step reads back)
        tokens = len(rows) * T
        if self.verifier.ragged_prefill:  # (no padding: the pieces' own tokens)
            tokens = sum(min(T, len(r.prompt) - r.filled) for r in rows)
        self._chunk_marks = (tokens, max(starts) + T, m0, self._clock.mark())
        return self._piece_done(rows, T, h_last, t0)

    def _next_piece(self) -> tuple | None:
        """The waiting requests join the prefill queue; the next piece (:meth:`_plan_piece`),
        paced for a forward shared with the running rows' verify, or None."""
        if self.waiting:
            new, self.waiting = self.waiting, []
            self._admit(new)
        if not self.prefilling:
            return None
        return self._plan_piece(self._chunk_limit())

    def _plan_piece(self, fits) -> tuple[list[Row], int, int, list[int]]:
        """``(rows, T, first slot, starts)``: the next prefill forward's rows (the queue's first
        ``n``, :meth:`_chunk_rows`) and piece length, their cache columns reserved and their
        slots ready (rows this piece finishes in the slots right after the batch, a piece of a
        longer prompt in its row's parked slot)."""
        self.prefilling.sort(key=lambda r: (len(r.prompt) - r.filled, r.rid))
        if self._oldest_turn and self.rows:  # every other piece: the oldest request's
            oldest = min(range(len(self.prefilling)), key=lambda i: self.prefilling[i].rid)
            self.prefilling.insert(0, self.prefilling.pop(oldest))
        self._oldest_turn = not self._oldest_turn
        n, T = self._chunk_rows(fits)
        rows, cache = self.prefilling[:n], self.cache
        starts = [r.filled for r in rows]
        # the columns the rows need to their end, at their first piece: the cache grows once per
        # long prompt (growing copies every row's columns: 136-214 ms a time for 8 chats and a
        # 4,000-token prompt's pieces on a small CPU, and it drops captured graphs), not at
        # each doubling its pieces reach; a CPU buffer's new columns take no memory until written
        cache.reserve(cache.slots, max(max(starts) + T + 1, self._width(rows)), self._used_columns)
        if starts[0] + T >= len(rows[0].prompt):  # every row taken finishes: they join
            first = cache.batch
            for i, r in enumerate(rows):
                if r.slot is not None:
                    cache.move_row(r.slot, first + i, r.filled)
                    r.slot = None
                self._copy_reused(r, first + i)
        else:  # one row, a piece of its prompt
            first = rows[0].slot if rows[0].slot is not None else self._park(rows[0])
            self._copy_reused(rows[0], first)
        self.totals["prefills"] += 1
        return rows, T, first, starts

    def _copy_reused(self, row: Row, slot: int) -> None:
        """Write the cached prefix's entries of ``row`` (:meth:`_reuse_prefix`) into ``slot``."""
        if row.reused is not None:
            self.prefix.copy(row.reused, row.filled, self.cache.kv[:, :, slot, :, : row.filled])
            row.reused = None

    def _piece_done(self, rows: list[Row], T: int, h_last: torch.Tensor, t0: float) -> list:
        """After a piece's forward (begun at ``t0``): the rows' progress; those whose whole
        prompt is in join the batch (:meth:`_join`)."""
        for r in rows:
            r.filled = min(len(r.prompt), r.filled + T)
        done = sum(
            r.filled == len(r.prompt) for r in rows
        )  # a prefix of the queue (see _chunk_rows)
        events = self._join(rows[:done], h_last[:done]) if done else []
        for r in rows:
            r.stats.prefill_time += time.perf_counter() - t0  # the first token's read synced
        return events

    def _chunk_rows(self, fits) -> tuple[int, int]:
        """``(n, T)``: the first ``n`` rows of the prefill queue get up to ``T`` more prompt
        tokens each in an ``[n, T]`` forward that ``fits(n * T, span)`` allows (``span``: the
        columns it attends over) and, where the forward is padded (not a flattened prefill,
        ``Verifier.ragged_prefill``), pads at most ``MAX_PADDING`` of its real tokens (the
        queue is shortest first). Either one row gets a piece of a longer prompt (under "auto"
        a multiple of ``PREFILL_CHUNK_MIN`` when it is that long: late in a 4,000-token prompt
        on a CPU a piece of a few tokens already costs a decode step, its attention over the
        whole prompt; any length where it rides in the verify forward) or every row taken is
        finished by this forward (the rows that join are always the queue's first)."""
        rem = [len(r.prompt) - r.filled for r in self.prefilling]
        start = [r.filled for r in self.prefilling]
        T = rem[0]
        if not fits(T, start[0] + T):
            lo, hi = 0, T  # fits(lo) (or lo == 0), not fits(hi): the largest T that fits
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid, start[0] + mid) else (lo, mid)
            # fewer distinct shapes, except where the piece rides in the verify forward: its
            # shape changes with the tree every step anyway, and rounding made budgets that give
            # 8-57-token pieces 16 or 32 by the fit's wobble (one engine admitted the same prompt
            # in 61 steps once and in 30 the next time, 8 prompts added together)
            riding = self.fuse and bool(self.rows)
            if self.config.prefill_chunk == "auto" and lo >= PREFILL_CHUNK_MIN and not riding:
                lo = lo // PREFILL_CHUNK_MIN * PREFILL_CHUNK_MIN
            return 1, max(lo, 1)
        n, real = 1, T
        # a flattened prefill forward (Verifier.ragged_prefill) pads nothing: its rows cost
        # their own tokens, whatever their lengths and their starts (rows whose prefix was
        # cached, a long prompt's last piece)
        ragged = self.verifier.ragged_prefill and not (self.fuse and self.rows)
        # a padded forward: only prompts that start at the same column (fresh, or after the same
        # cached system prompt) share it, as every row attends over its longest span
        while n < len(rem) and (ragged or start[0] == start[n]):
            T2, real2 = max(T, rem[n]), real + rem[n]
            tokens = real2 if ragged else (n + 1) * T2
            if tokens > (1 + MAX_PADDING) * real2 or not fits(tokens, max(start[: n + 1]) + T2):
                break
            n, T, real = n + 1, T2, real2
        return n, T

    def _chunk_limit(self):
        """``fits(tokens, span)``: whether a prefill forward of ``tokens`` (rows x columns)
        attending over ``span`` columns may run in this step (``DecoderConfig.prefill_chunk``:
        0: always; a number: up to that many tokens; "auto": up to ``PREFILL_CHUNK_MAX`` while
        nobody decodes, else what :class:`~redraft.infer.engine.pacer.PrefillPacer` predicts to
        cost no more than its share of the running rows' step, or before it has timed a chunk,
        what the cost curve (measured now if no step has yet) says)."""
        chunk = self.config.prefill_chunk
        if chunk != "auto":
            return (lambda N, S: N <= chunk) if chunk else (lambda N, S: True)
        if self.speculator.cost_curve is not None:
            self._observe_chunk()
        if not self.rows:
            return self._idle_fits()
        if all(len(r.prompt) - r.filled <= PREFILL_CHUNK_MIN for r in self.prefilling):
            return lambda N, S: N <= PREFILL_CHUNK_MIN  # whatever the cost: no need to measure it
        curve = self.speculator.cost_curve
        if curve is None:
            curve = self.speculator.measure_cost()
        # the reference step scaled to every admitted request: while the streams' next
        # requests wait here the batch is small and its step cheap, and chunks paced by that
        # step would keep it small (the prefill falls behind the requests arriving)
        B, admitted = len(self.rows), len(self.rows) + len(self.prefilling)
        per_row = max(1, self._step_tokens // B)
        c = curve_np(curve, [admitted * per_row, B * per_row])
        steps = min(max(float(c[0] / c[1]), 1.0), admitted / B)
        # more requests waiting than decoding (a burst): stalling the few rows for a bigger
        # piece lets the many start sooner (one round of 16 streams: TTFT 2.7-4.1 s, of which
        # 0.15-0.25 s prefilling, with pieces of one step)
        steps = max(steps, min(len(self.prefilling) / B, IDLE_STEPS))
        fits = self._pacer.fits(steps, fused=self.fuse)
        if fits is None:
            cap = prefill_chunk(curve, self._step_tokens)
            return lambda N, S: N <= cap
        return fits

    def _idle_fits(self):
        """``fits`` while nobody decodes (nobody to stall): large pieces, but not so large that
        a request arriving meanwhile waits long for its turn (``IDLE_STEPS`` reference steps)."""
        fits = self._pacer.fits(IDLE_STEPS, capped=False)
        if fits is None:
            return lambda N, S: N <= PREFILL_CHUNK_MAX
        return lambda N, S: N <= PREFILL_CHUNK_MAX and fits(N, S)

    def _observe_chunk(self) -> None:
        """Give the pacer the last prefill forward's measured time."""
        if self._chunk_marks is None:
            return
        tokens, span, m0, m1 = self._chunk_marks
        if self._clock.cuda:
            m1.synchronize()  # done already (a step read back since); never an error
        self._pacer.observe(tokens, span, self._clock.seconds(m0, m1), self.speculator.cost_curve)
        self._chunk_marks = None
