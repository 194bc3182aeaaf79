"""Learning-free drafters (N-Grammys, Stewart et al. 2024): context n-grams and model tables.

* :class:`ContextNGramDrafter`: match the last ``q`` tokens of each row (prompt + output so far)
  and propose what followed earlier matches. Candidates are ranked by how often their first
  token followed the match (counts), the most recent match winning ties; each candidate
  continues with the ``w`` tokens after its most recent match.
* :class:`TableDrafter`: rows of the model-derived tables (``redraft.ngrams.NGramTables``):
  ``"bigram"`` (top-k next tokens after ``y``), ``"extended"`` (top-k chains of w tokens after
  ``y``) or ``"unigram"`` (the k most likely tokens anywhere).
* :class:`NGrammysDrafter`: the paper's mixed strategy: fill k rows from context matches
  first, the rest from the extended bigram rows of ``y``.

Tables only need ``unigram_topk(k)``, ``bigram_topk(tokens [N], k)`` and
``extended(tokens [N]) -> [N, k, w]``; everything here is batched tensor code.
"""

from __future__ import annotations

import functools

import torch

from redraft.infer.config import FIELDS
from redraft.infer.spec.drafter import DecodeState, Draft, HostDrafter
from redraft.infer.spec.hostdraft import (
    GROUPS_PER_CLASS,
    HostTables,
    context_matches_np,
    ngrammys_np,
    table_rows_np,
)
from redraft.infer.spec.paths import PAD, cached_arange, pad_paths

# defaults come from DecoderConfig (one place for each)
K, W, Q, Q_MAX = (FIELDS[n].default for n in ("ngram_k", "ngram_w", "context_q", "context_q_max"))


@functools.lru_cache(maxsize=64)
def _match_index(T: int, q_max: int, device):
    """Index tensors of :func:`context_matches_multi` for rows of ``T`` tokens (made once: the
    token buffer of a request keeps its width): positions ``p [M]`` (1..T-1), ``i [q_max]``, the
    flat gather index of the ``q_max`` tokens before each p (last first) ``[1, M*q_max]``, and
    ``i < p`` ``[1, M, q_max]``."""
    p = torch.arange(1, T, device=device)
    i = torch.arange(q_max, device=device)
    before = (p[:, None] - 1 - i[None]).clamp_min(0).reshape(1, -1)
    return p, i, before, (i[None, None] < p[None, :, None])


def context_matches_multi(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    q_min: int,
    q_max: int,
    k: int,
    w: int,
    vocab_size: int,
    window: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context matches of every length from ``q_max`` down to ``q_min``, longest first.

    A longer match predicts better (transformers' prompt lookup also tries the longest n-gram
    first), so rows of a ``q_max``-token match come first; a row whose first token a longer
    match already proposed is dropped; the first ``k`` rows that remain are kept.

    Returns:
        ``(paths [B, k, w], group [B, k])``: the statistics group of a row is
        ``(q_max - q) * GROUPS_PER_CLASS + min(rank among rows of that q, GROUPS_PER_CLASS - 1)``,
        so the decoder learns how often a 3-token match is right apart from a 1-token one.
    """
    B, T = tokens.shape
    dev = tokens.device
    C = q_max - q_min + 1
    if T <= q_min:
        return (
            torch.full((B, k, w), PAD, dtype=torch.long, device=dev),
            torch.zeros((B, k), dtype=torch.long, device=dev),
        )
    # one pass over every length: ell[b, p] = how many tokens before position p agree with the
    # row's last tokens (capped at q_max); p is the first continuation token of that match
    p, i, before_idx, i_lt_p = _match_index(T, q_max, dev)
    before = tokens.gather(1, before_idx.expand(B, -1)).reshape(B, -1, q_max)  # [B, M, q_max]
    suffix = tokens.gather(
        1, (lengths[:, None] - 1 - i[None]).clamp_min(0)
    )  # [B, q_max], last token first
    agree = (before == suffix[:, None, :]) & i_lt_p & (i[None, None] < (lengths[:, None, None] - 1))
    ell = agree.long().cumprod(dim=-1).sum(dim=-1)  # [B, M]
    ok = (ell >= q_min) & (
        p[None] < lengths[:, None]
    )  # tokens before a row's length are real (>= 0)
    if T > window:  # only rows longer than the window can have matches outside it
        ok &= p[None] - ell >= lengths[:, None] - window
    f = torch.where(ok, tokens[:, 1:], 0)
    # each first token competes in its longest match length (class), by count then recency there:
    # one amax over ell * (T + 1) + p gives, per token, the longest match and its latest position
    key = torch.full((B, vocab_size), -1, dtype=torch.long, device=dev).scatter_reduce_(
        1, f, torch.where(ok, ell * (T + 1) + p, -1), reduce="amax"
    )
    best, recent = key.div(T + 1, rounding_mode="floor"), key.remainder(T + 1)
    in_class = ok & (ell >= best.gather(1, f))
    counts = torch.zeros((B, vocab_size), dtype=torch.long, device=dev).scatter_add_(
        1, f, in_class.long()
    )
    score = torch.where(counts > 0, (best * (T + 1) + counts) * (T + 1) + recent, -1)
    kk = min(k, vocab_size)
    top = score.topk(kk, dim=1)
    start = recent.gather(1, top.indices)  # [B, kk] first continuation token of the chosen match
    cont = start[:, :, None] + cached_arange(w, dev)[None, None]
    paths = tokens.gather(1, cont.clamp(0, T - 1).reshape(B, -1)).reshape(B, kk, w)
    found = top.values >= 0
    paths = torch.where(found[:, :, None] & (cont < lengths[:, None, None]), paths, PAD)
    cls = (q_max - best.gather(1, top.indices)).clamp(0, C - 1)  # 0 = the longest match length
    onehot = torch.nn.functional.one_hot(cls, C) * found[:, :, None]
    rank = (onehot.cumsum(dim=1) * onehot).sum(dim=-1) - 1
    group = torch.where(found, cls * GROUPS_PER_CLASS + rank.clamp(0, GROUPS_PER_CLASS - 1), 0)
    if kk < k:
        paths = pad_paths(paths.transpose(1, 2), k).transpose(1, 2)
        group = torch.cat([group, group.new_zeros((B, k - kk))], dim=1)
    return paths, group


class ContextNGramDrafter(HostDrafter):
    """Prompt/output n-gram lookup: k candidate rows of w tokens after matches of the last q
    tokens; with ``q_max > q``, matches of every length from ``q_max`` down to ``q``, longest
    first (:func:`context_matches_multi`), each length its own statistics group."""

    def __init__(
        self,
        vocab_size: int,
        q: int = Q,
        k: int = K,
        w: int = W,
        window: int = 4096,
        name: str = "context",
        q_max: int | None = Q_MAX,
    ):
        self.vocab_size, self.q, self.k, self.w, self.window, self.name = (
            vocab_size,
            q,
            k,
            w,
            window,
            name,
        )
        self.q_max = max(q_max or q, q)

    def propose_host(self, host) -> Draft:
        paths, group = context_matches_np(
            host.seqs, self.q, self.q_max, self.k, self.w, self.vocab_size, self.window
        )
        return Draft(tokens=paths, group=group)

    def propose(self, state: DecodeState) -> Draft:
        paths, group = context_matches_multi(
            state.tokens,
            state.lengths,
            self.q,
            self.q_max,
            self.k,
            self.w,
            self.vocab_size,
            self.window,
        )
        return Draft(tokens=paths, group=group)


class TableDrafter(HostDrafter):
    """Rows of model-derived n-gram tables: ``kind`` is "bigram", "extended" or "unigram"."""

    KINDS = ("bigram", "extended", "unigram")

    def __init__(
        self,
        tables,
        kind: str = "extended",
        k: int = K,
        w: int | None = None,
        name: str | None = None,
    ):
        if kind not in self.KINDS:
            from redraft.errors import ConfigError

            raise ConfigError(f"table drafter kind {kind!r} is unknown; use one of {self.KINDS}.")
        self.tables, self.kind, self.k, self.w = tables, kind, k, w
        self.name = name or kind
        self._host = None

    def propose_host(self, host) -> Draft:
        self._host = self._host or HostTables(self.tables)
        tokens, logp = table_rows_np(self.kind, self._host, host.last, self.k, self.w)
        return Draft(tokens=tokens, logp=logp)

    def propose(self, state: DecodeState) -> Draft:
        B, dev = state.batch_size, state.device
        if self.kind == "unigram":
            ids, probs = self.tables.unigram_topk(self.k)
            ids = ids.to(dev).long()[None, :, None].expand(B, -1, -1)
            return Draft(
                tokens=ids,
                logp=probs.to(dev).float().clamp_min(1e-12).log()[None, :, None].expand(B, -1, -1),
            )
        if self.kind == "bigram":
            ids, probs = self.tables.bigram_topk(state.last, self.k)
            return Draft(
                tokens=ids.to(dev).long()[:, :, None],
                logp=probs.to(dev).float().clamp_min(1e-12).log()[:, :, None],
            )
        ids = self.tables.extended(state.last).to(dev).long()[:, : self.k]  # [B, k, w]
        if self.w is not None:
            ids = ids[:, :, : self.w]
        return Draft(tokens=ids)


class NGrammysDrafter(HostDrafter):
    """N-Grammys mixed strategy: k rows, context matches first, the rest from the extended bigram.

    Context rows hold up to ``w`` tokens; with ``q_max > q`` they come from matches of every
    length ``q_max .. q``, longest first. Table rows are the extended chains of ``y`` (cut at
    ``w``) and form their own statistics groups.
    """

    def __init__(
        self,
        tables,
        vocab_size: int,
        k: int = K,
        w: int = W,
        q: int = Q,
        window: int = 4096,
        name: str = "ngrammys",
        q_max: int | None = Q_MAX,
    ):
        self.tables, self.vocab_size, self.k, self.w, self.q, self.window = (
            tables,
            vocab_size,
            k,
            w,
            q,
            window,
        )
        self.q_max = max(q_max or q, q)
        self.name = name
        self._host = None

    def propose_host(self, host) -> Draft:
        self._host = self._host or HostTables(self.tables)
        paths, group = ngrammys_np(
            host.seqs,
            host.last,
            self._host,
            self.vocab_size,
            self.k,
            self.w,
            self.q,
            self.q_max,
            self.window,
        )
        return Draft(tokens=paths, group=group)

    def propose(self, state: DecodeState) -> Draft:
        ctx, cgroup = context_matches_multi(
            state.tokens,
            state.lengths,
            self.q,
            self.q_max,
            self.k,
            self.w,
            self.vocab_size,
            self.window,
        )
        ext = pad_paths(
            self.tables.extended(state.last).to(state.device).long()[:, : self.k, : self.w], self.w
        )
        B, E = ext.shape[:2]
        table_class = (self.q_max - self.q + 1) * GROUPS_PER_CLASS
        egroup = table_class + torch.arange(E, device=ext.device).clamp(max=GROUPS_PER_CLASS - 1)[
            None
        ].expand(B, E)
        rows = torch.cat([ctx, ext], dim=1)  # [B, k + k', w]
        group = torch.cat([cgroup, egroup], dim=1)
        # context rows that exist come first, then table rows; keep the first k
        empty = (rows[:, :, 0] < 0).long()
        order = torch.sort(empty, dim=1, stable=True).indices[:, : self.k]
        return Draft(
            tokens=rows.gather(1, order[:, :, None].expand(-1, -1, self.w)),
            group=group.gather(1, order),
        )
