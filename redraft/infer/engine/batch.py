"""The batch's rows: a row joins once its prompt is in the cache, and leaves when it is done.

:class:`BatchRows` is the engine's membership half: :class:`~redraft.infer.engine.engine.Engine`
inherits it, and its methods read the engine's rows, cache, state, verifier and speculator.
Joining samples a row's first token and appends it to the batch (cache, device state, drafters);
leaving drops finished and cancelled rows with few moves (rows above the new end fill the holes).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from redraft.infer.engine.rows import Row
from redraft.infer.spec.accept import (
    RowSampling,
    logprob_table,
    processed_logits,
    sample_tokens,
    token_logprobs,
)
from redraft.infer.spec.drafter import DecodeState
from redraft.infer.spec.paths import PAD
from redraft.infer.stats import StreamEvent


class BatchRows:
    """The rows of an engine's batch joining and leaving (see the module doc)."""

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
        if self.speculator.host_drafters:
            gone = [i for i, r in enumerate(self.rows) if r.done]
            self.speculator.retire_rows(self._host_state(), gone)
        if self.prefix is not None:  # what they held, for requests that start the same way
            for i, r in enumerate(self.rows):
                if r.done:
                    n = min(int(self.cache.host_lengths[i]), r.length)
                    self.prefix.store(r.seq[:n], self.cache.kv[:, :, i, :, :n])
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
        self.speculator.select_rows(idx)

    def _sampling(self, rows: list[Row] | None = None) -> RowSampling:
        rows = self.rows if rows is None else rows
        return RowSampling(
            [r.params.temperature for r in rows],
            [r.params.top_p for r in rows],
            [r.generator or self.generator for r in rows],
            self.device,
            uniforms=[r.uniforms for r in rows],
            top_k=[r.params.top_k for r in rows],
            min_p=[r.params.min_p for r in rows],
            logprobs=[r.params.logprobs for r in rows],
        )

    def _join(self, new: list[Row], h_last: torch.Tensor) -> list[StreamEvent]:
        """Rows ``new`` (the first of the prefill queue, their prompts all in the cache, in the
        slots right after the active rows; ``h_last [n, H]`` their last hidden states): sample
        their first token and append them to the batch (cache, state, drafters)."""
        spec, cache = self.speculator, self.cache
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
        if spec.device_drafters:
            self._join_state(new, y, h_last, start)
        spec.add_rows(self._host_state() if spec.host_drafters else None, self.state, start)
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
