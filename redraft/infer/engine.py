"""The decode loop, one step at a time: rows join, decode together, and leave.

    engine = decoder.engine()
    rid = engine.add(prompt_ids, SamplingParams.checked(max_new_tokens=64))
    while engine.has_work:
        for event in engine.step():          # StreamEvent: text delta, tokens, done
            ...

One :meth:`Engine.step` is a sequence of named calls::

    retire finished rows -> join new rows (prefill) -> draft -> tree -> verify -> accept
    -> read the step's results (the one host read) -> commit -> advance -> feedback -> emit

Everything up to the read is device work whose shapes the host knows without looking at the
device (on CUDA with static trees; on CPU reading a tree size costs nothing); the step's
results (accepted counts, emitted tokens, per-drafter credit, tree sizes, chosen budget) come
back in one packed tensor. Text is detokenised incrementally per row (``TextStream``).

Rows have their own cache length and sampling settings (temperature, top-p, seed), so the
server can add a request while others decode (it is prefilled and joins at the next step) and
remove one whose client left. ``SpeculativeDecoder.generate`` is this loop with every request
added up front.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from redraft.errors import ConfigError
from redraft.infer.accept import RowSampling, emitted_tokens, sample_tokens, seed_uniforms
from redraft.infer.config import SamplingParams, check_prompt
from redraft.infer.drafters.base import PAD, DecodeState
from redraft.infer.stats import Generation, RequestStats, StreamEvent
from redraft.infer.text import TextStream
from redraft.infer.tree import build_tree


@dataclass
class _Row:
    """Host-side record of one request."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    text: TextStream
    uniforms: torch.Tensor | None = None  # a seeded request's own random numbers, one per output token
    tokens: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    length: int = 0  # tokens in the state's buffer (prompt + output so far)
    done: bool = False
    t_start: float = 0.0

    def take(self, toks: list[int], eos: set) -> tuple[list[int], str, str | None]:
        """Append a step's tokens: ``(tokens kept, text delta, finish reason or None)``."""
        new, reason = [], None
        for t in toks:
            if len(self.tokens) >= self.params.max_new_tokens:
                break
            self.tokens.append(t)
            new.append(t)
            if t in eos:
                reason = "eos"
                break
            if t in self.params.stop_token_ids:  # kept in the tokens, its text left out (as vLLM does)
                reason = "stop"
                break
        if reason is None and len(self.tokens) >= self.params.max_new_tokens:
            reason = "length"
        text = self.text.add(new[:-1] if reason == "stop" else new)
        if self.text.stopped:
            reason = "stop"
        if reason:
            text += self.text.finish()
        self.stats.new_tokens = len(self.tokens)
        return new, text, reason


def _params(params) -> SamplingParams:
    """``SamplingParams``, or a dict of its fields (checked), or None (the defaults)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, dict):
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        if unknown := sorted(set(params) - known):
            raise ConfigError(f"unknown sampling parameter(s) {unknown}; use {sorted(known)}.", param=unknown[0])
        return SamplingParams.checked(**params)
    if not hasattr(params, "max_new_tokens"):
        raise ConfigError(f"params must be a SamplingParams or a dict of its fields, not {type(params).__name__}.",
                          param="params")
    return params


class _Clock:
    """Step timestamps: CUDA events on a GPU (read after the step's one host read, no extra
    sync), ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class Engine:
    """Continuous batching over a :class:`~redraft.infer.decoder.SpeculativeDecoder`.

    Not thread-safe: one thread owns an engine (the server runs it in its decode thread and
    passes ``add``/``cancel`` in between steps).
    """

    def __init__(self, decoder):
        self.dec = decoder
        self.verifier = decoder.verifier
        self.device = decoder.target.device
        self.rows: list[_Row] = []  # aligned with the rows of self.state
        self.waiting: list[_Row] = []
        self.state: DecodeState | None = None
        self.cache = None
        self.sampling: RowSampling | None = None
        self.steps = 0
        self._next_id = 0
        self._clock = _Clock(self.device)
        self._context = getattr(decoder.model.config, "max_position_embeddings", None)

    # ------------------------------------------------------------------ requests

    def add(self, prompt: list[int], params: SamplingParams | None = None, generator=None) -> int:
        """Queue a request (token ids, checked) to join the batch at the next step; returns its id.
        ``params``: a :class:`SamplingParams` or a dict of its fields (``{"max_new_tokens": 64}``).

        A request with ``params.seed`` samples its ``i``-th output token with the ``i``-th
        uniform of its seed (inverse CDF): its output depends only on its seed and its own
        logits, whoever shares the batch. ``generator``: without a seed, the ``torch.Generator``
        its samples come from (default: the decoder's shared one).
        """
        params = _params(params)
        if not params.greedy and self.dec.config.acceptance == "greedy":
            raise ConfigError("temperature > 0 needs the decoder's acceptance 'rejection' (lossless) or "
                              "'typical'; this decoder verifies greedily.", param="temperature")
        check_prompt(prompt, self.dec.target.vocab_size, self._context, params.max_new_tokens)
        uniforms = None
        if params.seed is not None:
            # one per output token, and slack for draws a tree makes past the last one
            uniforms = seed_uniforms(params.seed, params.max_new_tokens + 256)
            if generator is None:  # drafters that sample (HSDDW's chains) draw from it
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
        rid = self._next_id
        self._next_id += 1
        self.waiting.append(_Row(rid, list(prompt), params, generator, TextStream(self.dec.target.tokenizer, params.stop),
                                 uniforms))
        return rid

    def cancel(self, rid: int) -> None:
        """Drop request ``rid``: it leaves the batch at the next step, with no final event."""
        self.waiting = [r for r in self.waiting if r.rid != rid]
        for r in self.rows:
            if r.rid == rid:
                r.done = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(not r.done for r in self.rows)

    @property
    def batch_size(self) -> int:
        """Requests decoding now (not counting those waiting to join)."""
        return sum(not r.done for r in self.rows)

    @property
    def kv_usage(self) -> tuple[int, int]:
        """(tokens the running rows hold in the KV cache, token slots allocated over all rows)."""
        if self.cache is None:
            return 0, 0
        return sum(r.length - 1 for r in self.rows if not r.done), self.cache.capacity * self.cache.batch_size

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[StreamEvent]:
        """Retire finished rows, prefill and join waiting ones, then one draft/verify step for
        all rows; returns the events of this step (text deltas, finished requests)."""
        self._retire()
        events = self._join() if self.waiting else []
        self._retire()
        if not self.rows:
            return events
        dec, state, cache = self.dec, self.state, self.cache
        clock = self._clock
        t0 = clock.mark()
        prop = dec.propose(state, dec.guard.speculate(state.batch_size))  # paths [B, P, L] of the drafters called
        budget, size = dec.choose_budget(prop, self.verifier)
        tree = build_tree(prop.paths, prop.values, budget, root=state.last, size=size)
        t1 = clock.mark()
        hidden = self.verifier.verify(tree.tokens, tree.depth, tree.anc, cache)  # [B, N, H]
        self.sampling.offset = state.lengths - state.prompt_lengths  # output tokens so far, per row
        acc = dec.accept(tree, self.verifier.logits(hidden), self.sampling)
        credit, hit = dec.credit(prop, tree, acc)  # [B, drafters] accepted tokens each proposed
        emitted = emitted_tokens(tree, acc)  # [B, D+1]
        t2 = clock.mark()
        host = self._read(acc.num_accepted, emitted, credit, tree, prop, budget if prop.k is None else prop.k)  # the one host read
        n_acc = [r[0] for r in host]
        new_len = [row.length + n + 1 for row, n in zip(self.rows, n_acc)]
        cache.commit(acc.path, acc.num_accepted + 1, physical=max(new_len) - 1)
        old = state
        self.state = self._advance(state, emitted, acc, hidden, tree, new_len)
        dec.feedback(old, prop, tree, acc, hit)
        secs = clock.seconds(t0, t1), clock.seconds(t1, t2)  # CUDA events are done: the read synced
        dec.after_step(prop, host, secs, n_acc)
        self.steps += 1
        return events + self._emit(host, secs)

    # ------------------------------------------------------------------ step pieces

    def _read(self, n_acc, emitted, credit, tree, prop, budget) -> list[list[int]]:
        """Everything the host needs from this step, in one transfer: per row
        ``[accepted, emitted tokens (D+1), credit per drafter, nodes, entries kept, entries
        proposed, budget]``."""
        B = n_acc.shape[0]
        budget_col = (budget if isinstance(budget, torch.Tensor) else torch.full((B,), int(budget or 0),
                                                                                 device=n_acc.device))
        cols = [n_acc[:, None], emitted, credit, (tree.num_nodes - 1)[:, None],
                (tree.path_node >= 0).sum(dim=(1, 2))[:, None], prop.raw_entries[:, None], budget_col[:, None]]
        return torch.cat([c.long() for c in cols], dim=1).tolist()

    def _advance(self, state: DecodeState, emitted, acc, hidden, tree, new_len: list[int]) -> DecodeState:
        """The state after this step: emitted tokens appended, the bonus as ``last``, the hidden
        state of the deepest accepted node."""
        B = state.batch_size
        buf = state.tokens
        if max(new_len) + 1 > buf.shape[1]:
            buf = torch.cat([buf, buf.new_full((B, max(new_len) + 1 - buf.shape[1] + 64), PAD)], dim=1)
        pos = (state.lengths[:, None] + torch.arange(emitted.shape[1], device=buf.device)[None]).clamp(max=buf.shape[1] - 1)
        buf = buf.scatter(1, pos, torch.where(emitted >= 0, emitted, buf.gather(1, pos)))
        for row, n in zip(self.rows, new_len):
            row.length = n
        rows = torch.arange(B, device=buf.device)
        return dataclasses.replace(state, tokens=buf, lengths=state.lengths + acc.num_accepted + 1, last=acc.bonus,
                                   hidden=hidden[rows, acc.last_node], step=state.step + 1)

    def _emit(self, host: list[list[int]], secs: tuple[float, float]) -> list[StreamEvent]:
        """Per row: stats, new tokens and text; a finished row gets its final event."""
        events = []
        nd = len(self.dec.drafters)
        names = [d.name for d in self.dec.drafters]
        for row, vals in zip(self.rows, host):
            n = vals[0]
            D1 = len(vals) - 5 - nd  # emitted tokens per row (D + 1)
            toks = vals[1:1 + n + 1]
            credit = vals[1 + D1:1 + D1 + nd]
            nodes, kept, raw = vals[1 + D1 + nd:4 + D1 + nd]
            s = row.stats
            s.target_calls += 1
            s.accepted_hist[n] += 1
            s.draft_time += secs[0]
            s.verify_time += secs[1]
            s.tree_nodes += nodes
            s.tree_entries += kept
            s.tree_entries_raw += raw
            for name, c in zip(names, credit):
                if c:
                    s.drafter_accepted[name] += c
            events += self._row_event(row, toks)
        return events

    def _row_event(self, row: _Row, toks: list[int]) -> list[StreamEvent]:
        if row.done:  # cancelled during this step
            return []
        new, text, reason = row.take(toks, self.dec.eos)
        if reason:
            row.done = True
            row.stats.total_time = time.perf_counter() - row.t_start
            g = Generation(text=row.text.text, tokens=row.tokens, finish_reason=reason, stats=row.stats)
            return [StreamEvent(row.rid, text, new, True, g)]
        return [StreamEvent(row.rid, text, new)] if new else []

    # ------------------------------------------------------------------ rows joining and leaving

    def _retire(self) -> None:
        """Drop finished and cancelled rows from the batch (state, cache, drafters)."""
        keep = [i for i, r in enumerate(self.rows) if not r.done]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.state = self.cache = self.sampling = None
            return
        idx = torch.tensor(keep, device=self.device)
        self.cache.select_rows(idx, physical=max(r.length - 1 for r in self.rows))
        s = self.state
        self.sampling = self._sampling()
        self.state = dataclasses.replace(s, tokens=s.tokens[idx], lengths=s.lengths[idx], last=s.last[idx],
                                         hidden=s.hidden[idx], prompt_lengths=s.prompt_lengths[idx],
                                         request_ids=s.request_ids[idx], sampling=self.sampling)
        for d in self.dec.drafters:
            d.select_rows(idx)

    def _sampling(self, rows: list[_Row] | None = None) -> RowSampling:
        rows = self.rows if rows is None else rows
        return RowSampling([r.params.temperature for r in rows], [r.params.top_p for r in rows],
                           [r.generator or self.dec.generator for r in rows], self.device,
                           uniforms=[r.uniforms for r in rows])

    def _join(self) -> list[StreamEvent]:
        """Prefill the waiting requests together, sample their first token, and append them to
        the batch (state, cache, drafters)."""
        new, self.waiting = self.waiting, []
        dev, dec = self.device, self.dec
        t0 = time.perf_counter()
        slack = dec.config.max_nodes + 2 if dec.drafters else 2
        width = max(len(r.prompt) + r.params.max_new_tokens for r in new) + slack + 1
        cache = self.verifier.new_cache(len(new), width)
        h_last = self.verifier.prefill([r.prompt for r in new], cache)  # [n, H]
        y = sample_tokens(self.verifier.logits(h_last), self._sampling(new))  # [n]
        y_host = y.tolist()
        prefill = time.perf_counter() - t0
        buf = torch.full((len(new), width), PAD, dtype=torch.long)
        for i, r in enumerate(new):
            buf[i, :len(r.prompt)] = torch.tensor(r.prompt)
            buf[i, len(r.prompt)] = y_host[i]
            r.length = len(r.prompt) + 1
            r.t_start, r.stats.prefill_time = t0, prefill
        plen = torch.tensor([len(r.prompt) for r in new], device=dev)
        part = DecodeState(tokens=buf.to(dev), lengths=plen + 1, last=y, hidden=h_last, prompt_lengths=plen,
                           step=0, request_ids=torch.tensor([r.rid for r in new], device=dev))
        start = len(self.rows)
        if self.state is None:
            self.state, self.cache = part, cache
        else:
            s = self.state
            W = max(s.tokens.shape[1], part.tokens.shape[1])
            toks = torch.cat([_widen(s.tokens, W), _widen(part.tokens, W)])
            self.cache.append_rows(cache)
            self.state = dataclasses.replace(
                s, tokens=toks, lengths=torch.cat([s.lengths, part.lengths]), last=torch.cat([s.last, y]),
                hidden=torch.cat([s.hidden, h_last.to(s.hidden.dtype)]),
                prompt_lengths=torch.cat([s.prompt_lengths, plen]),
                request_ids=torch.cat([s.request_ids, part.request_ids]))
        self.rows += new
        self.sampling = self._sampling()
        self.state = dataclasses.replace(self.state, sampling=self.sampling)
        for d in dec.drafters:
            d.add_rows(self.state, start)
        events = []
        for r, t in zip(new, y_host):
            events += self._row_event(r, [t])
        return events


def _widen(tokens: torch.Tensor, width: int) -> torch.Tensor:
    if tokens.shape[1] >= width:
        return tokens
    return torch.cat([tokens, tokens.new_full((tokens.shape[0], width - tokens.shape[1]), PAD)], dim=1)
