"""The decode loop, one step at a time: rows join, decode together, and leave.

    engine = decoder.engine()
    rid = engine.add(prompt_ids, SamplingParams.checked(max_new_tokens=64))
    while engine.has_work:
        for event in engine.step():          # StreamEvent: text delta, tokens, done
            ...

One :meth:`Engine.step` is a sequence of named calls, split between the host and the device::

    host:   retire -> join (prefill) -> propose -> build_tree (budget, then tree) -> upload
    device: verify (one forward; one CUDA graph launch) -> logits -> choices (the rule's picks)
    host:   read the choices (the step's one device read) -> accept -> commit -> feedback
            -> after_step -> emit

The host keeps every row's tokens, so the learning-free drafters (context n-grams, model
tables) draft from host memory and the tree is built in numpy (``redraft.infer.hostdraft``); the
device gets one packed tensor (:class:`~redraft.infer.verify.StepInput`) and gives back one:
the token each acceptance rule picks after every tree node (:class:`~redraft.infer.rows.StepReadout`). The accepted
path is then walked on the host (``redraft.infer.accept.walk``), the cache commits it, and
the drafters learn from it. Outside the target forward a greedy or N-Grammys step runs a
handful of tensor ops (``redraft.infer.opcount``; a test keeps it so). Drafters that draft on
the device (ReDrafter beams, HSDDW, ADED) read their paths back (a second read) and see a
device :class:`~redraft.infer.drafters.base.DecodeState` the engine keeps only for them.

Rows have their own cache length and sampling settings (temperature, top-p, seed), so the
server can add a request while others decode (it is prefilled and joins at the next step) and
remove one whose client left. The cache and its captured graphs live as long as the engine, so
a server (one engine) captures each shape once. ``SpeculativeDecoder.generate`` is this loop
with every request added up front.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch

from redraft.errors import ConfigError
from redraft.infer.accept import (
    HostAcceptance,
    RowSampling,
    logprob_table,
    processed_logits,
    sample_tokens,
    seed_uniforms,
    token_logprobs,
)
from redraft.infer.budget import (
    PREFILL_CHUNK_MAX,
    PREFILL_CHUNK_MIN,
    PrefillPacer,
    curve_np,
    prefill_chunk,
)
from redraft.infer.config import SamplingParams, check_prompt
from redraft.infer.drafters.base import PAD, DecodeState
from redraft.infer.processors import RowProcessors
from redraft.infer.rows import Clock, HostState, Row, StepReadout, sampling_params_of
from redraft.infer.stats import Generation, StreamEvent
from redraft.infer.text import NoText, TextStream
from redraft.infer.verify import StepInput

if TYPE_CHECKING:  # the decoder imports the engine
    from redraft.infer.decoder import SpeculativeDecoder

MAX_PADDING = 0.5  # prompts share a prefill forward while its padding stays below this share
IDLE_STEPS = 8  # while nobody decodes, a step's prefill may cost this many reference steps


class Engine:
    """Continuous batching over a :class:`~redraft.infer.decoder.SpeculativeDecoder`, whose public
    step pieces it calls in order (``propose``, ``build_tree``, ``choices``, ``accept``,
    ``feedback``, ``after_step``) and whose ``verifier`` runs the forwards.

    Not thread-safe: one thread owns an engine (the server runs it in its decode thread and
    passes ``add``/``cancel`` in between steps).
    """

    def __init__(self, decoder: SpeculativeDecoder, text: bool = True):
        self.dec = decoder
        self.text = text  # False: events carry token ids only (no detokenisation, no stop strings)
        self.verifier = decoder.verifier
        self.device = decoder.target.device
        self.rows: list[Row] = []  # aligned with the cache's active slots
        self.prefilling: list[Row] = []  # being prefilled, in the slots after the active rows
        self.waiting: list[Row] = []
        self.state: DecodeState | None = None  # only when a drafter drafts on the device
        self.cache = None  # SlotKVCache, made at the first join, kept for the engine's life
        self.sampling: RowSampling | None = None
        self.steps = 0
        # wall time of the steps' prefill part (its first tokens' read syncs it) and of the
        # whole steps, prefill forwards and the rows decoded, summed (distillation reports them)
        # ("fused": pieces that rode in a verify forward, timed with the step)
        self.totals = {
            "prefill_s": 0.0,
            "step_s": 0.0,
            "prefills": 0,
            "fused": 0,
            "row_steps": 0,
        }
        # the running rows' last verify forward (batch x tree tokens) and the last prefill
        # forward's (tokens, span, clock marks): what the "auto" prefill chunk is paced by
        self._step_tokens = 0
        self._chunk_marks = None
        self._pacer = PrefillPacer(decoder.config.prefill_share)
        self._oldest_turn = False  # the next prefill piece goes to the oldest request
        # prefill pieces ride in the running rows' verify forward (DecoderConfig.fuse_prefill)
        fuse = decoder.config.fuse_prefill
        self.fuse = self.verifier.can_fuse and fuse in ("auto", True)
        self._next_id = 0
        self._clock = Clock(self.device)
        self._context = getattr(decoder.model.config, "max_position_embeddings", None)
        if self.device.type == "cpu":
            check_thread(decoder)

    # ------------------------------------------------------------------ requests

    def add(self, prompt: list[int], params: SamplingParams | None = None, generator=None) -> int:
        """Queue a request (token ids, checked) to join the batch at the next step; returns its id.
        ``params``: a :class:`SamplingParams` or a dict of its fields (``{"max_new_tokens": 64}``).

        A request with ``params.seed`` samples its ``i``-th output token with the ``i``-th
        uniform of its seed (inverse CDF): its output depends only on its seed and its own
        logits, whoever shares the batch. ``generator``: without a seed, the ``torch.Generator``
        its samples come from (default: the decoder's shared one).
        """
        params = sampling_params_of(params)
        if not params.greedy and self.dec.config.acceptance == "greedy":
            raise ConfigError(
                "temperature > 0 needs the decoder's acceptance 'rejection' (lossless) or "
                "'typical'; this decoder verifies greedily.",
                param="temperature",
            )
        check_prompt(prompt, self.dec.target.vocab_size, self._context, params.max_new_tokens)
        if params.stop and not self.text:
            raise ConfigError(
                "stop strings need the text: this engine was made with text=False (token ids "
                "only); pass stop_token_ids, or use an engine with text=True.",
                param="stop",
            )
        V = self.dec.target.vocab_size
        for name, ids in (
            ("logit_bias", [t for t, _ in params.logit_bias]),
            ("stop_token_ids", params.stop_token_ids),
        ):
            if any(t >= V for t in ids):
                raise ConfigError(
                    f"{name} holds token id {max(ids)}, outside the vocabulary [0, {V}).",
                    param=name,
                )
        uniforms = None
        if params.seed is not None:
            # one per output token, and slack for draws a tree makes past the last one
            uniforms = seed_uniforms(params.seed, params.max_new_tokens + 256)
            if generator is None:  # drafters that sample (HSDDW's chains) draw from it
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
        rid = self._next_id
        self._next_id += 1
        self.waiting.append(
            Row(
                rid,
                list(prompt),
                params,
                generator,
                TextStream(self.dec.target.tokenizer, params.stop) if self.text else NoText(),
                uniforms,
            )
        )
        return rid

    def cancel(self, rid: int) -> None:
        """Drop request ``rid``: it leaves the batch at the next step, with no final event."""
        self.waiting = [r for r in self.waiting if r.rid != rid]
        for r in self.rows + self.prefilling:
            if r.rid == rid:
                r.done = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(not r.done for r in self.rows + self.prefilling)

    @property
    def batch_size(self) -> int:
        """Requests decoding now (not counting those waiting to join)."""
        return sum(not r.done for r in self.rows)

    @property
    def kv_usage(self) -> tuple[int, int]:
        """(tokens the running rows hold in the KV cache, token slots allocated over all rows)."""
        if self.cache is None:
            return 0, 0
        held = sum(r.length - 1 for r in self.rows if not r.done) + sum(
            r.filled for r in self.prefilling
        )
        return held, self.cache.capacity * self.cache.slots

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[StreamEvent]:
        """Retire finished rows, prefill one chunk of the waiting prompts (those it completes
        join), then one draft/verify step for all rows; returns the events of this step (text
        deltas, finished requests)."""
        tot, s0 = self.totals, time.perf_counter()
        self._retire()
        events, piece = [], None
        if self.waiting or self.prefilling:
            if self.fuse and self.rows:  # a piece rides in this step's verify forward
                piece = self._next_piece()
            else:
                events = self._prefill()
                tot["prefill_s"] += time.perf_counter() - s0
                self._retire()
        if not self.rows:
            tot["step_s"] += time.perf_counter() - s0
            return events
        dec, clock = self.dec, self._clock
        t0 = clock.mark()
        host = self._host_state()
        prop = dec.propose(host, self.state, dec.guard.speculate(len(self.rows)))
        tree = dec.build_tree(prop, host, self.verifier)
        step_in = self._upload(tree)
        self._step_tokens = step_in.packed.shape[0] * step_in.size
        t1 = clock.mark()
        if piece is None:
            hidden = self.verifier.verify(step_in, self.cache)  # [B, N, H]
        else:
            rows, T, first, starts = piece
            hidden, h_last = self.verifier.verify_with_piece(
                step_in,
                self.cache,
                [r.prompt[r.filled : r.filled + T] for r in rows],
                first,
                starts,
            )
        if self.sampling.seeded:  # output tokens so far: which uniform a seeded row's draw takes
            self.sampling.offset = torch.tensor([r.length - len(r.prompt) for r in self.rows]).to(
                self.device
            )
        self.sampling.proc = self._processors(self.rows, tree.tokens)
        choices, lp = dec.choices(step_in, self.verifier.logits(hidden), self.sampling)  # [R, B, N]
        t2 = clock.mark()
        readout = StepReadout(choices, lp)
        acc = dec.accept(tree, readout)  # the one host read, then the walk
        self._commit(tree, acc)
        before = self.state  # what the device drafters drafted from
        if before is not None:
            self._advance(acc, hidden)
        credit = dec.feedback(host, before, prop, tree, acc)
        secs = clock.seconds(t0, t1), clock.seconds(t1, t2)  # CUDA events are done: the read synced
        own = secs
        if piece is not None:  # the guard and the gate compare steps: not the piece's share
            cost = self._pacer.piece_seconds(len(rows) * T, max(starts) + T, dec.cost_curve)
            own = secs[0], max(secs[1] - cost, 0.2 * secs[1])  # (an estimate may overshoot)
        joint = dec.after_step(prop, acc, credit, own)
        self.steps += 1
        tot["row_steps"] += len(tree.tokens)
        events += self._emit(tree, prop, acc, credit, secs, readout.logprobs, joint)
        if piece is not None:  # the step's verify carried the piece (rows, T, starts: above)
            self._pacer.observe_verify(
                secs[1], self._step_tokens, dec.cost_curve, len(rows) * T, max(starts) + T
            )
            tot["fused"] += 1
            events += self._piece_done(rows, T, h_last, t0=s0)
        elif self.fuse and dec.cost_curve is not None:
            self._pacer.observe_verify(secs[1], self._step_tokens, dec.cost_curve)
        else:
            self._pacer.observe_step(secs[1])
        tot["step_s"] += time.perf_counter() - s0
        return events

    # ------------------------------------------------------------------ step pieces

    def _host_state(self) -> HostState:
        rows = self.rows
        seqs = [r.seq[: r.length] for r in rows]
        return HostState(
            seqs,
            np.array([s[-1] for s in seqs], np.int64),
            np.array([len(r.prompt) for r in rows], np.int64),
        )

    def _upload(self, tree) -> StepInput:
        """The tree and the rows' cache lengths in one packed tensor, one host-to-device copy."""
        B, N = tree.tokens.shape
        packed = np.empty((B, StepInput.width(N)), np.int64)
        packed[:, 0] = self.cache.host_lengths
        packed[:, 1 : 1 + N] = tree.tokens
        packed[:, 1 + N : 1 + 2 * N] = tree.depth
        packed[:, 1 + 2 * N : 1 + 3 * N] = tree.parent
        packed[:, 1 + 3 * N :] = tree.anc.reshape(B, N * N)
        t = torch.from_numpy(packed)
        if self.device.type != "cpu":
            t = t.to(self.device)  # the previous step's read synced: nothing to overlap with
        return StepInput(t, N)

    def _commit(self, tree, acc: HostAcceptance) -> None:
        """Keep the accepted nodes' keys and values: node ``j`` of row b was written at column
        ``length_b + j``, the accepted node at depth i belongs at ``length_b + i``; only nodes
        off the tree's first chain move. Then the rows' lengths grow."""
        cache = self.cache
        rows, src, dst = [], [], []
        for b, (n, path) in enumerate(zip(acc.num_accepted.tolist(), acc.path.tolist())):
            L = cache.host_lengths[b]
            for i in range(1, n + 1):
                if path[i] != i:
                    rows.append(b)
                    src.append(L + path[i])
                    dst.append(L + i)
            cache.host_lengths[b] = L + n + 1
        cache.commit_moves(rows, src, dst)
        for row, toks in zip(self.rows, acc.emitted):
            row.append(toks)

    def _advance(self, acc: HostAcceptance, hidden: torch.Tensor) -> None:
        """The device state the device drafters see: emitted tokens appended, the bonus as
        ``last``, the hidden state of the deepest accepted node (one upload)."""
        s = self.state
        B = s.batch_size
        D1 = max(len(e) for e in acc.emitted)
        buf = s.tokens
        new_len = [r.length for r in self.rows]
        if max(new_len) + 1 > buf.shape[1]:
            buf = torch.cat(
                [buf, buf.new_full((B, max(new_len) + 1 - buf.shape[1] + 64), PAD)], dim=1
            )
        up = np.full((B, 3 + D1), PAD, np.int64)
        for b, e in enumerate(acc.emitted):
            up[b, 3 : 3 + len(e)] = e
        up[:, 0] = new_len
        up[:, 1] = acc.last_node
        up[:, 2] = acc.bonus
        u = torch.from_numpy(up).to(self.device)
        old_len = s.lengths
        pos = (old_len[:, None] + torch.arange(D1, device=buf.device)[None]).clamp(
            max=buf.shape[1] - 1
        )
        em = u[:, 3:]
        buf = buf.scatter(1, pos, torch.where(em >= 0, em, buf.gather(1, pos)))
        rows = torch.arange(B, device=buf.device)
        self.state = dataclasses.replace(
            s,
            tokens=buf,
            lengths=u[:, 0],
            last=u[:, 2],
            hidden=hidden[rows, u[:, 1]].clone(),
            step=s.step + 1,
        )

    def _processors(self, rows: list[Row], tree_tokens: np.ndarray | None) -> RowProcessors | None:
        """The step's penalties / bias / min_tokens for the rows that use them (None if none)."""
        idx = [b for b, r in enumerate(rows) if r.params.processed]
        if not idx:
            return None
        sel = [rows[b] for b in idx]
        return RowProcessors.build(
            idx,
            [r.params for r in sel],
            [np.asarray(r.prompt, np.int64) for r in sel],
            [r.seq[len(r.prompt) : r.length] for r in sel],
            tree_tokens,
            self.dec.target.output_head.weight.shape[0],
            self.dec.eos,
            self.device,
        )

    def _emit(
        self, tree, prop, acc: HostAcceptance, credit: np.ndarray, secs, lp_table=None, joint=None
    ) -> list[StreamEvent]:
        """Per row: stats, new tokens and text; a finished row gets its final event. ``joint``:
        the exclusive gains ``[B, called]`` of a step with several drafters called
        (``SpeculativeDecoder.after_step``)."""
        events = []
        names = [d.name for d in self.dec.drafters]
        nodes = tree.num_nodes - 1
        kept = (
            (tree.path_node >= 0).sum(axis=(1, 2))
            if tree.path_node.size
            else np.zeros(len(self.rows), int)
        )
        lps = token_logprobs(lp_table, self.sampling, acc.path, acc.num_accepted, acc.emitted)
        called_names = [names[i] for i, _, _ in prop.marks]
        joint = None if joint is None else joint.tolist()
        # the per-row figures as Python lists at once (a numpy scalar read costs ~0.1 us each)
        nums, nodes, kept = acc.num_accepted.tolist(), nodes.tolist(), kept.tolist()
        raw = prop.raw_entries.tolist()
        credits = credit.tolist() if len(names) else [()] * len(nums)
        for b, row in enumerate(self.rows):
            n = nums[b]
            s = row.stats
            s.target_calls += 1
            s.accepted_hist[n] += 1
            s.draft_time += secs[0]
            s.verify_time += secs[1]
            s.tree_nodes += nodes[b]
            s.tree_entries += kept[b]
            s.tree_entries_raw += raw[b]
            for name, c in zip(names, credits[b]):
                if c:
                    s.drafter_accepted[name] += c
            for name in called_names:
                s.drafter_calls[name] += 1
            if joint is not None:
                s.joint_steps += 1
                for name, g in zip(called_names, joint[b]):
                    if g:
                        s.drafter_exclusive[name] += g
            events += self._row_event(row, acc.emitted[b], lps.get(b))
        return events

    def _row_event(self, row: Row, toks: list[int], lps: list | None = None) -> list[StreamEvent]:
        if row.done:  # cancelled during this step
            return []
        new, text, reason = row.take(toks, self.dec.eos)
        lps = None if lps is None else lps[: len(new)]
        if lps is not None:
            row.logprobs += lps
        if reason:
            row.done = True
            row.stats.total_time = time.perf_counter() - row.t_start
            g = Generation(
                text=row.text.text,
                tokens=row.tokens,
                finish_reason=reason,
                stats=row.stats,
                logprobs=row.logprobs if row.params.logprobs is not None else None,
            )
            return [StreamEvent(row.rid, text, new, True, g, lps)]
        return [StreamEvent(row.rid, text, new, logprobs=lps)] if new else []

    # ------------------------------------------------------------------ rows joining and leaving

    def _retire(self) -> None:
        """Drop finished and cancelled rows from the batch (cache, state, drafters) and from the
        prefill queue (a parked row's slot is simply free again)."""
        if any(r.done for r in self.prefilling):
            self.prefilling = [r for r in self.prefilling if not r.done]
        keep = [i for i, r in enumerate(self.rows) if not r.done]
        if len(keep) == len(self.rows):
            return
        # few moves: rows above the new end fill the holes the leaving rows leave (rows being
        # prefilled are not in these slots: nothing of theirs moves)
        if any(d.host for d in self.dec.drafters):
            host, gone = self._host_state(), [i for i, r in enumerate(self.rows) if r.done]
            for d in self.dec.drafters:
                if d.host:
                    d.retire_rows_host(host, gone)
        keep = _fill_holes(keep, 0)
        lengths = self.cache.host_lengths
        moved = [lengths[i] for t, i in enumerate(keep) if i != t]
        self.cache.keep_rows(keep, columns=max(moved, default=0) + 1)
        self.rows = [self.rows[i] for i in keep]
        self.sampling = self._sampling() if keep else None
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        if self.state is not None:
            s = self.state
            self.state = (
                None
                if not keep
                else dataclasses.replace(
                    s,
                    tokens=s.tokens[idx],
                    lengths=s.lengths[idx],
                    last=s.last[idx],
                    hidden=s.hidden[idx],
                    prompt_lengths=s.prompt_lengths[idx],
                    request_ids=s.request_ids[idx],
                    sampling=self.sampling,
                )
            )
        for d in self.dec.drafters:
            d.select_rows(idx)

    def _sampling(self, rows: list[Row] | None = None) -> RowSampling:
        rows = self.rows if rows is None else rows
        return RowSampling(
            [r.params.temperature for r in rows],
            [r.params.top_p for r in rows],
            [r.generator or self.dec.generator for r in rows],
            self.device,
            uniforms=[r.uniforms for r in rows],
            top_k=[r.params.top_k for r in rows],
            min_p=[r.params.min_p for r in rows],
            logprobs=[r.params.logprobs for r in rows],
        )

    def _reserve(self, new: list[Row]) -> None:
        """A cache with room for the running rows, those being prefilled (and a parked slot
        each) and ``new`` (made once, grown by doubling). The columns ``new`` will need are
        added at a row's first piece (:meth:`_plan_piece`; on a CPU a grown buffer's pages are
        zeroed only as they are touched: :func:`~redraft.infer.kv.zeroed`)."""
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
        dec = self.dec
        slack = dec.config.max_nodes + 2 if dec.drafters else 2
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
        with chunking off, every waiting prompt."""
        if self.waiting:
            new, self.waiting = self.waiting, []
            self._admit(new)
        fits = self._chunk_limit()
        chunk = self.dec.config.prefill_chunk
        off, idle = chunk == 0, chunk == "auto" and not self.rows
        t0, ref = time.perf_counter(), self._pacer.ref
        events = self._prefill_piece(fits)
        while self.prefilling and (off or idle):
            # (shortest first: once a piece is cut, only long prompts are left)
            cut = self.prefilling[0].filled > 0
            if idle and cut and self.rows:
                # only long prompts are left and prompts joined: they decode now, the long
                # ones' pieces riding with them (one round of 4 streams through HTTP: a server
                # that found all four prompts waiting prefilled the short ones, then the long
                # one's pieces for 8 reference steps before the short ones' first tokens, TTFT
                # p50 1.4-1.8 s against 0.5 s where they had arrived one step apart)
                break
            if idle and cut and ref is not None and time.perf_counter() - t0 >= IDLE_STEPS * ref:
                break
            if idle and self.dec.cost_curve is not None and self._chunk_timed():
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
        self._chunk_marks = (len(rows) * T, max(starts) + T, m0, self._clock.mark())
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
        else:  # one row, a piece of its prompt
            first = rows[0].slot if rows[0].slot is not None else self._park(rows[0])
        self.totals["prefills"] += 1
        return rows, T, first, starts

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
        columns it attends over) and that pads at most ``MAX_PADDING`` of its real tokens (the
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
            if self.dec.config.prefill_chunk == "auto" and lo >= PREFILL_CHUNK_MIN and not riding:
                lo = lo // PREFILL_CHUNK_MIN * PREFILL_CHUNK_MIN
            return 1, max(lo, 1)
        n, real = 1, T
        # only fresh prompts share a forward: a prompt's last piece attends over its earlier
        # ones, and every row of a forward attends over its longest span
        while n < len(rem) and start[0] == start[n] == 0:
            T2, real2 = max(T, rem[n]), real + rem[n]
            if (n + 1) * T2 > (1 + MAX_PADDING) * real2 or not fits(
                (n + 1) * T2, max(start[: n + 1]) + T2
            ):
                break
            n, T, real = n + 1, T2, real2
        return n, T

    def _chunk_limit(self):
        """``fits(tokens, span)``: whether a prefill forward of ``tokens`` (rows x columns)
        attending over ``span`` columns may run in this step (``DecoderConfig.prefill_chunk``:
        0: always; a number: up to that many tokens; "auto": up to ``PREFILL_CHUNK_MAX`` while
        nobody decodes, else what :class:`~redraft.infer.budget.PrefillPacer` predicts to
        cost no more than its share of the running rows' step, or before it has timed a chunk,
        what the cost curve (measured now if no step has yet) says)."""
        chunk = self.dec.config.prefill_chunk
        if chunk != "auto":
            return (lambda N, S: N <= chunk) if chunk else (lambda N, S: True)
        if self.dec.cost_curve is not None:
            self._observe_chunk()
        if not self.rows:
            return self._idle_fits()
        if all(len(r.prompt) - r.filled <= PREFILL_CHUNK_MIN for r in self.prefilling):
            return lambda N, S: N <= PREFILL_CHUNK_MIN  # whatever the cost: no need to measure it
        curve = self.dec.cost_curve
        if curve is None:
            curve = self.dec.measure_cost()
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
        self._pacer.observe(tokens, span, self._clock.seconds(m0, m1), self.dec.cost_curve)
        self._chunk_marks = None

    def _join(self, new: list[Row], h_last: torch.Tensor) -> list[StreamEvent]:
        """Rows ``new`` (the first of the prefill queue, their prompts all in the cache, in the
        slots right after the active rows; ``h_last [n, H]`` their last hidden states): sample
        their first token and append them to the batch (cache, state, drafters)."""
        dec, cache = self.dec, self.cache
        start = cache.batch
        sampling = self._sampling(new)
        sampling.proc = self._processors(new, None)
        logits = processed_logits(self.verifier.logits(h_last)[:, None], sampling)  # [n, 1, V]
        y = sample_tokens(logits[:, 0], sampling)  # [n]
        zeros = torch.zeros_like(y)[:, None]
        table = logprob_table(logits, y[:, None], zeros, zeros, sampling)  # [L, 1, 2 + 2k] or None
        y_host = y.tolist()
        lps = token_logprobs(
            None if table is None else table.float().cpu().numpy(),
            sampling,
            np.zeros((len(new), 1), np.int64),
            np.zeros(len(new), np.int64),
            [[t] for t in y_host],
        )
        cache.host_lengths += [len(r.prompt) for r in new]
        cache.batch += len(new)
        self.prefilling = self.prefilling[len(new) :]
        for r, t in zip(new, y_host):
            r.append(r.prompt + [t])
        self.rows += new
        self.sampling = self._sampling()
        if dec.device_drafters:
            self._join_state(new, y, h_last, start)
        host = self._host_state() if any(d.host for d in dec.drafters) else None
        for d in dec.drafters:
            if d.host:
                d.add_rows_host(host, start)
            else:
                d.add_rows(self.state, start)
        events = []
        for b, (r, t) in enumerate(zip(new, y_host)):
            events += self._row_event(r, [t], lps.get(b))
        return events

    def _join_state(
        self, new: list[Row], y: torch.Tensor, h_last: torch.Tensor, start: int
    ) -> None:
        """The device state of the new rows, appended to the running rows' (device drafters)."""
        dev = self.device
        width = max(r.length for r in new) + 64
        buf = torch.full((len(new), width), PAD, dtype=torch.long)
        for i, r in enumerate(new):
            buf[i, : r.length] = torch.from_numpy(r.seq[: r.length])
        plen = torch.tensor([len(r.prompt) for r in new], device=dev)
        part = DecodeState(
            tokens=buf.to(dev),
            lengths=plen + 1,
            last=y,
            hidden=h_last,
            prompt_lengths=plen,
            step=0,
            request_ids=torch.tensor([r.rid for r in new], device=dev),
        )
        if self.state is None or start == 0:
            self.state = part
        else:
            s = self.state
            W = max(s.tokens.shape[1], part.tokens.shape[1])
            self.state = dataclasses.replace(
                s,
                tokens=torch.cat([_widen(s.tokens, W), _widen(part.tokens, W)]),
                lengths=torch.cat([s.lengths, part.lengths]),
                last=torch.cat([s.last, y]),
                hidden=torch.cat([s.hidden, h_last.to(s.hidden.dtype)]),
                prompt_lengths=torch.cat([s.prompt_lengths, plen]),
                request_ids=torch.cat([s.request_ids, part.request_ids]),
            )
        self.state = dataclasses.replace(self.state, sampling=self.sampling)


def check_thread(decoder) -> None:
    """Warn (once per decoder) when a CPU engine is made on another thread than the one that
    built the decoder. PyTorch's CPU kernels run in a GNU OpenMP team that belongs to the thread
    that opened it; a second thread's team leaves more OpenMP threads than cores, and libgomp's
    idle workers then stop spinning between kernels, so every kernel pays a wake-up: on a
    small CPU a step of the default target took 1.2-1.5x as long on the other thread
    (``redraft.serve.scheduler.ComputeThread``, which ``redraft-serve`` loads and decodes on)."""
    home = getattr(decoder, "home_thread", None)
    if home in (None, threading.get_ident()) or torch.get_num_threads() < 2:
        return
    if getattr(decoder, "_thread_warned", False):  # once per decoder
        return
    decoder._thread_warned = True
    warnings.warn(
        "redraft: this engine decodes on another thread than the one that loaded the decoder; "
        "on a CPU each step can take 1.2-1.5x as long (PyTorch's OpenMP threads belong to the "
        "thread that started them). Load and decode on one thread, e.g. "
        "redraft.serve.scheduler.ComputeThread: decoder = compute.call(load_decoder, ...), then "
        "run the decoding there.",
        RuntimeWarning,
        stacklevel=3,
    )


def _fill_holes(slots: list[int], first: int) -> list[int]:
    """New order of rows now in ``slots`` (ascending) that are to occupy ``first ..
    first + len(slots) - 1``: rows already in that range stay where they are, the rows above it
    fill its holes (a row leaving moves one row, not every row after it)."""
    end = first + len(slots)
    taken = {s for s in slots if first <= s < end}
    holes = iter(t for t in range(first, end) if t not in taken)
    placed = {s: s for s in taken}
    for s in slots:
        if s >= end:
            placed[next(holes)] = s
    return [placed[t] for t in range(first, end)]


def _widen(tokens: torch.Tensor, width: int) -> torch.Tensor:
    if tokens.shape[1] >= width:
        return tokens
    return torch.cat(
        [tokens, tokens.new_full((tokens.shape[0], width - tokens.shape[1]), PAD)], dim=1
    )
