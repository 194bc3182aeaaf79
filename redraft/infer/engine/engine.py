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
tables) draft from host memory and the tree is built in numpy
(``redraft.infer.spec.hostdraft``); the device gets one packed tensor
(:class:`~redraft.infer.runner.step_input.StepInput`) and gives back one: the token each acceptance
rule picks after every tree node (:class:`~redraft.infer.engine.rows.StepReadout`). The
accepted path is then walked on the host (``redraft.infer.spec.accept.walk``), the cache commits
it, and the drafters learn from it. Outside the target forward a greedy or N-Grammys step runs
a handful of tensor ops (``redraft.infer.runner.opcount``; a test keeps it so). Drafters that
draft on the device (ReDrafter beams, HSDDW, ADED) read their paths back (a second read) and see
a device :class:`~redraft.infer.spec.drafter.DecodeState` the engine keeps only for them.

Rows have their own cache length and sampling settings (temperature, top-p, seed), so the
server can add a request while others decode (it is prefilled and joins at the next step) and
remove one whose client left. The cache and its captured graphs live as long as the engine, so
a server (one engine) captures each shape once. ``SpeculativeDecoder.generate`` is this loop
with every request added up front.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from redraft.errors import ConfigError
from redraft.infer.config import SamplingParams, check_prompt
from redraft.infer.engine.batch import BatchRows
from redraft.infer.engine.processors import RowProcessors
from redraft.infer.engine.rows import Row, StepReadout, sampling_params_of
from redraft.infer.engine.scheduler import PrefillScheduler
from redraft.infer.engine.text import NoText, TextStream
from redraft.infer.runner.clock import Clock
from redraft.infer.runner.step_input import StepInput
from redraft.infer.spec.accept import (
    HostAcceptance,
    RowSampling,
    seed_uniforms,
    token_logprobs,
)
from redraft.infer.spec.drafter import DecodeState, HostState
from redraft.infer.spec.paths import PAD
from redraft.infer.stats import Generation, StreamEvent

if TYPE_CHECKING:
    from redraft.infer.config import DecoderConfig
    from redraft.infer.engine.prefix import PrefixCache
    from redraft.infer.runner.verify import Verifier
    from redraft.infer.spec.speculator import Speculator


class Engine(PrefillScheduler, BatchRows):
    """Continuous batching over the speculative step: the ``speculator``'s pieces called in order
    (``propose``, ``build_tree``, ``choices``, ``accept``, ``feedback``, ``after_step``), the
    ``verifier``'s forwards, the prefill queue of :class:`PrefillScheduler`, the rows joining and
    leaving of :class:`~redraft.infer.engine.batch.BatchRows`.

    Args:
        target: the :class:`redraft.models.Target` (its device, vocabulary, tokenizer).
        speculator: the :class:`~redraft.infer.spec.speculator.Speculator` (its drafters).
        verifier: the :class:`~redraft.infer.runner.verify.Verifier` of ``target``.
        config: the :class:`~redraft.infer.config.DecoderConfig` (acceptance, prefill settings).
        eos: the token ids that end a request (default: the target's).
        generator: where rows without a seed or a generator of their own sample from (None:
            torch's default generator).
        text: False: events carry token ids only (no detokenisation, no stop strings).
        prefix: a :class:`~redraft.infer.engine.prefix.PrefixCache` finished rows leave their
            KV entries in and new rows reuse them from (None: every prompt prefilled whole).

    ``SpeculativeDecoder.engine()`` makes one over the decoder's parts. Not thread-safe: one
    thread owns an engine (the server runs it in its decode thread and passes ``add``/``cancel``
    in between steps).

    Not thread-safe: one thread owns an engine (the server runs it in its decode thread and
    passes ``add``/``cancel`` in between steps).
    """

    def __init__(
        self,
        target,
        speculator: Speculator,
        verifier: Verifier,
        config: DecoderConfig,
        *,
        eos: set[int] | None = None,
        generator: torch.Generator | None = None,
        text: bool = True,
        prefix: PrefixCache | None = None,
    ):
        self.target = target
        self.speculator = speculator
        self.verifier = verifier
        self.config = config
        self.eos = set(target.eos_token_ids) if eos is None else eos
        self.generator = generator  # rows without their own: the shared sampling generator
        self.text = text  # False: events carry token ids only (no detokenisation, no stop strings)
        self.prefix = prefix  # finished rows' KV by their tokens (DecoderConfig.prefix_cache)
        self.device = target.device
        self.rows: list[Row] = []  # aligned with the cache's active slots
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
        self._init_queue(config)
        # prefill pieces ride in the running rows' verify forward (DecoderConfig.fuse_prefill)
        fuse = config.fuse_prefill
        self.fuse = self.verifier.can_fuse and fuse in ("auto", True)
        # an idle burst prefills every waiting prompt, long ones too, before it decodes (set
        # per call by SpeculativeDecoder.stream; generate() waits for the whole batch)
        self.whole_prompts = False
        self._next_id = 0
        self._clock = Clock(self.device)
        self._context = getattr(target.model.config, "max_position_embeddings", None)

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
        if not params.greedy and self.config.acceptance == "greedy":
            raise ConfigError(
                "temperature > 0 needs the decoder's acceptance 'rejection' (lossless) or "
                "'typical'; this decoder verifies greedily.",
                param="temperature",
            )
        check_prompt(prompt, self.target.vocab_size, self._context, params.max_new_tokens)
        if params.stop and not self.text:
            raise ConfigError(
                "stop strings need the text: this engine was made with text=False (token ids "
                "only); pass stop_token_ids, or use an engine with text=True.",
                param="stop",
            )
        V = self.target.vocab_size
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
                TextStream(self.target.tokenizer, params.stop) if self.text else NoText(),
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
        spec, clock = self.speculator, self._clock
        t0 = clock.mark()
        host = self._host_state()
        prop = spec.propose(host, self.state, spec.guard.speculate(len(self.rows)))
        tree = spec.build_tree(prop, host, self.verifier)
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
        choices, lp = spec.choices(
            step_in, self.verifier.logits(hidden), self.sampling
        )  # [R, B, N]
        t2 = clock.mark()
        readout = StepReadout(choices, lp)
        acc = spec.accept(tree, readout)  # the one host read, then the walk
        self._commit(tree, acc)
        before = self.state  # what the device drafters drafted from
        if before is not None:
            self._advance(acc, hidden)
        credit = spec.feedback(host, before, prop, tree, acc)
        secs = clock.seconds(t0, t1), clock.seconds(t1, t2)  # CUDA events are done: the read synced
        own = secs
        if piece is not None:  # the guard and the gate compare steps: not the piece's share
            cost = self._pacer.piece_seconds(len(rows) * T, max(starts) + T, spec.cost_curve)
            own = secs[0], max(secs[1] - cost, 0.2 * secs[1])  # (an estimate may overshoot)
        joint = spec.after_step(prop, acc, credit, own)
        self.steps += 1
        tot["row_steps"] += len(tree.tokens)
        events += self._emit(tree, prop, acc, credit, secs, readout.logprobs, joint)
        if piece is not None:  # the step's verify carried the piece (rows, T, starts: above)
            self._pacer.observe_verify(
                secs[1], self._step_tokens, spec.cost_curve, len(rows) * T, max(starts) + T
            )
            tot["fused"] += 1
            events += self._piece_done(rows, T, h_last, t0=s0)
        elif self.fuse and spec.cost_curve is not None:
            self._pacer.observe_verify(secs[1], self._step_tokens, spec.cost_curve)
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
            self.target.output_head.weight.shape[0],
            self.eos,
            self.device,
        )

    def _emit(
        self, tree, prop, acc: HostAcceptance, credit: np.ndarray, secs, lp_table=None, joint=None
    ) -> list[StreamEvent]:
        """Per row: stats, new tokens and text; a finished row gets its final event. ``joint``:
        the exclusive gains ``[B, called]`` of a step with several drafters called
        (``SpeculativeDecoder.after_step``)."""
        events = []
        names = [d.name for d in self.speculator.drafters]
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
        new, text, reason = row.take(toks, self.eos)
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
