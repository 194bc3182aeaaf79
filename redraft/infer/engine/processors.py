"""Logits processors that depend on what came before: presence / frequency / repetition
penalties, ``logit_bias`` and ``min_tokens`` (``SamplingParams``), exact under speculation.

The logits after tree node n are the target's next-token logits given the row's tokens plus
n's ancestor path, so a penalty there must count the row's output so far *plus the tokens on
that path* (not the tokens of other branches). Worked example: output so far ``[7, 9]``, a tree
``root -> 9 -> 4`` and ``root -> 7``: after node "9" token 9 counts twice, after node "4" token
9 twice and token 4 once, after node "7" token 7 twice. Then greedy speculative output equals
plain greedy with the same processors, and rejection sampling draws from the processed
distribution at every node (the acceptance rule is unchanged).

Only the rows that use a processor pay for it, and only at the tokens a penalty can change:
per such row the host lists its *candidates* (the tokens of its output, of its prompt when it has
a repetition penalty, and of its tree) with their counts so far, and where each tree node's
token sits among them; that is one upload per step (:meth:`RowProcessors.build`). On the device
the tree's counts are one ``scatter_add`` of the ancestor mask ``[s, N, N]`` into ``[s, N, U]``
(U candidates), the penalised logits one gather and one ``scatter_add`` of the changes; the bias
is one add of a dense ``[s, V]`` row, ``min_tokens`` one ``masked_fill`` of the stop tokens at
nodes whose output count is still too small.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RowProcessors:
    """One step's processors for rows ``rows [s]`` of the batch (the others are untouched).

    ``cand [s, U]`` candidate tokens (padding repeats the first), ``count [s, U]`` their
    occurrences in the output so far, ``seen [s, U]`` 0/1 in the prompt or output (repetition
    penalty), ``pad [s, U]`` 0 for padding columns, ``node_col [s, N]`` the candidate column of
    every tree node's token (``U``, a dummy column, for the root and padding), ``out_len [s]``
    output tokens so far; per row ``presence``, ``frequency``, ``repetition`` ``[s]``, ``bias
    [s, V]`` (or None), ``min_tokens [s]`` and ``stoppers [s, V]`` bool (or None).
    """

    rows: torch.Tensor
    cand: torch.Tensor
    count: torch.Tensor
    seen: torch.Tensor
    pad: torch.Tensor
    node_col: torch.Tensor | None
    out_len: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    bias: torch.Tensor | None
    min_tokens: torch.Tensor
    stoppers: torch.Tensor | None
    penalties: bool

    @classmethod
    def build(
        cls,
        rows: list[int],
        params: list,
        prompts: list[np.ndarray],
        outputs: list[np.ndarray],
        tree_tokens: np.ndarray | None,
        vocab_size: int,
        eos,
        device,
    ) -> RowProcessors:
        """Host arrays of the rows ``rows`` (``params``, ``prompts``, ``outputs``: theirs, output
        = tokens emitted so far, the tree's root included), ``tree_tokens [B, N]`` the batch's
        tree (None at the join: no tree yet); one upload."""
        s = len(rows)
        N = 0 if tree_tokens is None else tree_tokens.shape[1]
        per_row = [
            _candidates(p, prompt, out, tree_tokens[r, 1:] if N else None)
            for r, p, prompt, out in zip(rows, params, prompts, outputs)
        ]
        packed, U = _pack(per_row, rows, outputs, tree_tokens, N)
        up = torch.from_numpy(packed).to(device)
        f = torch.tensor(
            [
                [p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens]
                for p in params
            ],
            dtype=torch.float32,
        ).to(device)
        bias = _bias(params, s, vocab_size, device)
        stoppers = _stoppers(params, s, vocab_size, eos, device)
        penalties = any(
            p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1 for p in params
        )
        return cls(
            rows=torch.tensor(rows, dtype=torch.long).to(device),
            cand=up[:, :U],
            count=up[:, U : 2 * U],
            seen=up[:, 2 * U : 3 * U].bool(),
            pad=up[:, 3 * U : 4 * U],
            node_col=up[:, 4 * U : 4 * U + N] if N else None,
            out_len=up[:, -1],
            presence=f[:, 0],
            frequency=f[:, 1],
            repetition=f[:, 2],
            bias=bias,
            min_tokens=f[:, 3],
            stoppers=stoppers,
            penalties=penalties,
        )

    def apply(
        self,
        logits: torch.Tensor,
        anc: torch.Tensor | None = None,
        depth: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``logits [B, N, V]`` after every tree node (``anc [B, N, N]`` ancestor mask, self
        included; ``depth [B, N]``) -> the processed logits (float32 for the processed rows)."""
        idx = self.rows
        sub = logits[idx].float()  # [s, N, V]
        s, N, V = sub.shape
        if self.bias is not None:
            sub = sub + self.bias[:, None, :]
        if self.penalties:
            U = self.cand.shape[1]
            cnt = self.count[:, None, :].expand(s, N, U).float()
            seen = self.seen[:, None, :].expand(s, N, U)
            if self.node_col is not None:  # the tokens on each node's path, root excluded
                path = torch.zeros(s, N, U + 1, device=sub.device).scatter_add_(
                    2, self.node_col[:, None, :].expand(s, N, N), anc[idx].float()
                )
                cnt = cnt + path[..., :U]
                seen = seen | (path[..., :U] > 0)
            cols = self.cand[:, None, :].expand(s, N, U)
            lg = sub.gather(2, cols)
            rep = self.repetition[:, None, None]
            new = torch.where(seen, torch.where(lg > 0, lg / rep, lg * rep), lg)
            new = (
                new
                - self.frequency[:, None, None] * cnt
                - self.presence[:, None, None] * (cnt > 0).float()
            )
            sub = sub.scatter_add(
                2, cols, (new - lg) * self.pad[:, None, :]
            )  # padding columns change nothing
        if self.stoppers is not None:
            d = (
                torch.zeros(s, N, dtype=torch.long, device=sub.device)
                if depth is None
                else depth[idx]
            )
            early = (self.out_len[:, None] + d) < self.min_tokens[:, None]  # [s, N]
            sub = sub.masked_fill(early[:, :, None] & self.stoppers[:, None, :], float("-inf"))
        return logits.float().index_copy(0, idx, sub)


def _candidates(p, prompt: np.ndarray, out: np.ndarray, tree: np.ndarray | None):
    """One row's candidate tokens (sorted), their counts in the output so far, and whether each
    was seen (in the output, or in the prompt under a repetition penalty); ``tree`` the row's
    tree tokens past the root (None: no tree)."""
    parts = [out]
    if p.repetition_penalty != 1:
        parts.append(prompt)
    if tree is not None:
        parts.append(tree[tree >= 0])
    cand = np.unique(np.concatenate(parts)) if any(len(x) for x in parts) else np.zeros(1, np.int64)
    uo, co = np.unique(out, return_counts=True)
    cnt = np.zeros(len(cand), np.int64)
    cnt[np.searchsorted(cand, uo)] = co
    seen = cnt > 0
    if p.repetition_penalty != 1:
        seen |= np.isin(cand, prompt)
    return cand, cnt, seen


def _pack(per_row: list, rows: list[int], outputs: list, tree_tokens, N: int):
    """The rows' candidates in one host array ``[s, 4U + N + 1]`` (cand | count | seen | pad |
    node_col | out_len), and U."""
    U = max(len(c) for c, _, _ in per_row)
    packed = np.zeros((len(rows), 4 * U + N + 1), np.int64)
    for i, (cand, cnt, seen) in enumerate(per_row):
        u = len(cand)
        packed[i, :U] = cand[0]
        packed[i, :u] = cand
        packed[i, U : U + u] = cnt
        packed[i, 2 * U : 2 * U + u] = seen
        packed[i, 3 * U : 3 * U + u] = 1
        if N:
            t = tree_tokens[rows[i]]
            col = np.full(N, U, np.int64)
            ok = t >= 0
            ok[0] = False  # the root is in the output already
            col[ok] = np.searchsorted(cand, t[ok])
            packed[i, 4 * U : 4 * U + N] = col
        packed[i, -1] = len(outputs[i])
    return packed, U


def _bias(params: list, s: int, vocab_size: int, device) -> torch.Tensor | None:
    """The rows' ``logit_bias`` as dense rows ``[s, V]`` (None when no row has one)."""
    if not any(p.logit_bias for p in params):
        return None
    bias = torch.zeros(s, vocab_size)
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            if t < vocab_size:
                bias[i, t] += b
    return bias.to(device)


def _stoppers(params: list, s: int, vocab_size: int, eos, device) -> torch.Tensor | None:
    """The rows' stop tokens ``[s, V]`` bool, for ``min_tokens`` (None when no row has one)."""
    if not any(p.min_tokens for p in params):
        return None
    stoppers = torch.zeros(s, vocab_size, dtype=torch.bool)
    for i, p in enumerate(params):
        for t in set(eos) | set(p.stop_token_ids):
            if t < vocab_size:
                stoppers[i, t] = True
    return stoppers.to(device)
