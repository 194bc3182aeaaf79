"""HSDDW (Syu & Lee 2025): entropy self-verify and hierarchical pre-verification of drafts.

* **Self-verify.** A draft model stops drafting when the entropy of its next-token distribution
  exceeds ``tau``; ``tau`` is the running mean of the entropies of the draft tokens its verifier
  rejected so far in this request, starting at 0 (:class:`EntropyThreshold`, in
  :mod:`redraft.infer.drafters.hsddw.threshold`). The first token of a chain is always drafted
  (with ``tau = 0`` every later one would stop the chain).
* **Draft models.** Anything that gives next-token distributions over the target vocab for a
  batch of rows (:class:`ProbModel`): any causal LM that shares the target's tokenizer
  (:class:`CausalLMModel`), an *early-exit* draft cut from the target itself
  (:func:`early_exit_model`: its first ``L`` layers, final norm and head, sharing the weights, so
  no extra memory), or the tri-gram table (:class:`TrigramModel`). Every target therefore has a
  hierarchy with no training. They live in :mod:`redraft.infer.drafters.hsddw.models`.
* **Hierarchy.** M1 drafts with self-verify; M2 pre-verifies M1's tokens by rejection sampling
  (one M2 forward over the chain), keeps its own correction token, and hands the chain back to
  M1 to extend while M2's entropy stays under M2's own ``tau``; when M2 loses confidence the
  chain goes to the target (:class:`HSDDWDrafter`). In greedy decoding the chain is M2's greedy
  chain; when sampling, every chain token is a sample of M2's (temperature/top-p warped)
  distribution (:mod:`redraft.infer.drafters.hsddw.sampling`). The decoder verifies the chain's
  tokens as point masses, which keeps the target's distribution exactly whatever the drafts are
  (``redraft.infer.spec.accept``).
* **Stats** (:class:`HierarchyStats`): redundancy ``sigma = 1 - accepted / drafted`` per level
  and target utilisation ``eta = target calls / output length``.

**Batching.** All rows draft together: every M1 step is one forward of the whole batch, every
M2 pre-verification one forward over every row's chain, with masks for rows that stopped. Each
draft LM keeps one KV cache for the batch (``redraft.infer.runner.kv.SlotKVCache``: rows of different
lengths). The drafter keeps a token buffer ``[B, W]`` per row (committed tokens, then the chain
being drafted); a model's cache always holds a prefix of its row's buffer. At each
:meth:`HSDDWDrafter.propose` the buffer's old chain is compared with what the target committed:
a row's cache keeps the common prefix and forgets the rest by lowering the row's length (no
re-prefill), and the first forward feeds each row only the tokens its cache lacks.

Worked example (one row, greedy, ``max_len=4``, ``m1_max=2``): committed ``[a b y]``; M1 feeds
``y`` and drafts ``c`` (the first token is always kept), feeds ``c`` and drafts ``d``; M2 feeds
``y c d`` in one forward, agrees on ``c``, prefers ``e`` over ``d`` and adds it: the chain is
``c e``; both caches drop ``d`` (length back to 4). M1 then feeds ``e`` and drafts on. Next step
the target committed ``c e z``: the caches keep ``a b y c e`` and feed ``z``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from redraft.errors import ConfigError
from redraft.infer.drafters.hsddw.models import (
    CausalLMModel,
    ProbModel,
    TrigramModel,
    early_exit_model,
    frequent_tokens,
)
from redraft.infer.drafters.hsddw.sampling import _draft_probs, _draw, _uniform
from redraft.infer.drafters.hsddw.threshold import EntropyThreshold
from redraft.infer.spec.accept import RowSampling, entropy, greedy_tokens
from redraft.infer.spec.drafter import DecodeState, Draft, Drafter, Feedback
from redraft.infer.spec.paths import PAD, cached_arange

# The draft models live in models.py and the threshold in threshold.py; their names are
# re-exported here.
__all__ = [
    "EntropyThreshold",
    "early_exit_model",
    "ProbModel",
    "CausalLMModel",
    "TrigramModel",
    "frequent_tokens",
    "LevelStats",
    "HierarchyStats",
    "HSDDWDrafter",
    "default_hierarchy",
    "entropy",
]


# ---------------------------------------------------------------------------------- hierarchy


@dataclass
class LevelStats:
    """One level of the hierarchy: tokens it drafted and how many its verifier accepted."""

    drafted: int = 0
    accepted: int = 0

    @property
    def sigma(self) -> float:
        """Redundancy ``1 - accepted / drafted`` (0 when nothing was drafted)."""
        return 1.0 - self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class HierarchyStats:
    """HSDDW's statistics for one batch: per level redundancy, target utilisation, time, and
    ``model_calls``: forwards (table look-ups) of each level's model."""

    levels: dict = field(default_factory=dict)
    target_calls: int = 0
    output_tokens: int = 0
    draft_seconds: float = 0.0
    model_calls: dict = field(default_factory=dict)

    @property
    def eta(self) -> float:
        """Target utilisation: target calls / output length (1 = plain decoding)."""
        return self.target_calls / self.output_tokens if self.output_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "eta": self.eta,
            "target_calls": self.target_calls,
            "output_tokens": self.output_tokens,
            "draft_seconds": self.draft_seconds,
            "model_calls": dict(self.model_calls),
            "levels": {
                k: {"drafted": v.drafted, "accepted": v.accepted, "sigma": v.sigma}
                for k, v in self.levels.items()
            },
        }


@dataclass
class _Chain:
    """Tokens drafted by one level for every row: ``tokens [B, R]`` (``PAD`` after ``n[b]``),
    the entropy ``ent [B, R]`` and log-probability ``logp [B, R]`` each was drafted at, the
    distributions ``dists [B, R, V]`` (kept only when some row samples), counts ``n [B]``."""

    tokens: torch.Tensor
    ent: torch.Tensor
    logp: torch.Tensor
    dists: torch.Tensor | None
    n: torch.Tensor


def _preverified(
    c1: _Chain, p2: torch.Tensor, g2: torch.Tensor, samp: RowSampling, greedy_row, ar
) -> torch.Tensor:
    """How many of M1's tokens M2 accepts per row ``[B]``: greedy rows by argmax, sampled rows by
    rejection sampling (accept t with probability min(1, p2(t) / q1(t)))."""
    B, R = c1.tokens.shape
    t1 = c1.tokens.clamp_min(0)
    ok = g2[:, :R] == c1.tokens
    if c1.dists is not None:
        q_t = c1.dists.gather(2, t1[:, :, None])[:, :, 0]  # [B, R] q1 of M1's own tokens
        ratio = p2[:, :R].gather(2, t1[:, :, None])[:, :, 0] / q_t.clamp_min(1e-30)
        ok = torch.where(greedy_row[:, None], ok, _uniform(samp, B, R, ar.device) < ratio)
    ok = ok & (ar[None] < c1.n[:, None])
    return ok.long().cumprod(dim=1).sum(dim=1)


def _m2_token(
    c1: _Chain, p2: torch.Tensor, g2: torch.Tensor, n_ok, rejected, samp: RowSampling
) -> torch.Tensor:
    """M2's own token after the accepted ones ``[B]``: its correction (greedy: its argmax;
    sampled: from the residual max(0, p2 - q1)) or, all accepted, its next token."""
    R = c1.tokens.shape[1]
    extra = g2.gather(1, n_ok[:, None])[:, 0]
    if c1.dists is not None:
        p_at = p2.gather(1, n_ok[:, None, None].expand(-1, 1, p2.shape[-1]))[:, 0]  # [B, V]
        last = n_ok.clamp(max=R - 1)[:, None, None].expand(-1, 1, p2.shape[-1])
        q_at = c1.dists.gather(1, last)[:, 0]
        res = (p_at - q_at * rejected[:, None]).clamp_min(0)
        mass = res.sum(-1, keepdim=True)
        extra = _draw(torch.where(mass > 0, res / mass.clamp_min(1e-30), p_at), extra, samp)
    return extra


class HSDDWDrafter(Drafter):
    """One chain per row from M1 (self-verify), pre-verified and extended by M2 when given.

    All rows draft at once (see the module doc); each row samples at its own temperature and
    top-p from its own generator (``state.sampling``), so ``generate(seed=...)`` reproduces the
    sampled chains.

    Args:
        m1: the fast draft model (:class:`ProbModel`, or an ``nn.Module`` causal LM).
        m2: the stronger draft model that pre-verifies M1's tokens, or ``None`` (M1 alone, its
            ``tau`` learning from the target's rejections).
        max_len: tokens per chain at most.
        m1_max: tokens M1 drafts per round before M2 checks them.
        tau_init: starting ``tau`` of both levels (the paper: 0).
        name: stats label.
    """

    def __init__(
        self,
        m1,
        m2=None,
        max_len: int = 8,
        m1_max: int = 4,
        tau_init: float = 0.0,
        name: str = "hsddw",
    ):
        if max_len < 1 or m1_max < 1:
            raise ConfigError(
                f"HSDDW needs max_len >= 1 and m1_max >= 1 (got {max_len}, {m1_max})."
            )
        self.m1 = m1 if isinstance(m1, ProbModel) else CausalLMModel(m1, "m1")
        self.m2 = (
            None if m2 is None else (m2 if isinstance(m2, ProbModel) else CausalLMModel(m2, "m2"))
        )
        self.max_len, self.m1_max, self.tau_init = max_len, m1_max, tau_init
        self.name = name
        self.tau1 = EntropyThreshold(0, tau_init)
        self.tau2 = EntropyThreshold(0, tau_init)
        self.stats = HierarchyStats()
        self._buf: torch.Tensor | None = (
            None  # [B, W] committed tokens, then the chain being drafted
        )
        self._synced: torch.Tensor | None = None  # [B] committed tokens at the last propose
        self._ent: torch.Tensor | None = (
            None  # [B, max_len] final level's entropy at each chain token
        )
        self._len: torch.Tensor | None = None  # [B] chain lengths of the last propose

    @property
    def models(self) -> list:
        return [self.m1] if self.m2 is None else [self.m1, self.m2]

    # ------------------------------------------------------------------ life cycle

    def add_rows(self, state: DecodeState, start: int) -> None:
        B, dev = state.batch_size, state.device
        n = B - start
        if start == 0 or self._buf is None:
            for m in self.models:
                m.reset(0)
            self.tau1 = EntropyThreshold(0, self.tau_init, device=dev)
            self.tau2 = EntropyThreshold(0, self.tau_init, device=dev)
            self.stats = HierarchyStats(levels={m.name: LevelStats() for m in self.models})
            self._buf = torch.full((0, 1), PAD, dtype=torch.long, device=dev)
            self._synced = torch.zeros(0, dtype=torch.long, device=dev)
        for m in self.models:
            m.add_rows(n)
        self.tau1.add_rows(n)
        self.tau2.add_rows(n)
        self._buf = torch.cat([self._buf, self._buf.new_full((n, self._buf.shape[1]), PAD)])
        self._synced = torch.cat([self._synced, self._synced.new_zeros(n)])

    def select_rows(self, keep: torch.Tensor) -> None:
        for m in self.models:
            m.select_rows(keep)
        self.tau1.select_rows(keep)
        self.tau2.select_rows(keep)
        keep = keep.to(self._buf.device)
        self._buf, self._synced = self._buf[keep], self._synced[keep]

    # ------------------------------------------------------------------ drafting

    def _sync(self, state: DecodeState) -> None:
        """Make the buffer the committed tokens; every model forgets the tokens of its row that
        the target did not commit (its cache keeps the prefix it shares with them)."""
        tok, L = state.tokens, state.lengths
        old = self._buf
        # below the last sync's length the models saw committed tokens; past it at most a chain
        cols = self._synced[:, None] + cached_arange(self.max_len + 1, tok.device)  # [B, W]
        same = (
            (
                old.gather(1, cols.clamp(max=old.shape[1] - 1))
                == tok.gather(1, cols.clamp(max=tok.shape[1] - 1))
            )
            & (cols < L[:, None])
            & (cols < old.shape[1])
        )
        valid = self._synced + same.long().cumprod(dim=1).sum(dim=1)  # [B]
        for m in self.models:
            m.truncate(valid)
        width = int(L.max()) + self.max_len + 2  # room for a chain and M2's last token
        if tok.shape[1] >= width:
            self._buf = tok[:, :width].clone()
        else:
            self._buf = torch.cat(
                [tok, tok.new_full((tok.shape[0], width - tok.shape[1]), PAD)], dim=1
            )
        self._synced = L.clone()

    def _write(self, pos: torch.Tensor, tok: torch.Tensor, rows: torch.Tensor) -> None:
        """``buf[b, pos[b]] = tok[b]`` for the rows where ``rows [B]`` holds."""
        p = pos.clamp(max=self._buf.shape[1] - 1)[:, None]
        self._buf.scatter_(1, p, torch.where(rows, tok, self._buf.gather(1, p)[:, 0])[:, None])

    def _m1_chain(self, start: torch.Tensor, room: torch.Tensor, samp: RowSampling) -> _Chain:
        """M1 drafts up to ``room[b]`` tokens after ``buf[b, :start[b]]`` (written to the buffer
        from ``start``), one forward of the batch per token; a row stops before a token whose
        entropy exceeds its tau1 (its first token is always drafted). Rows with ``room`` 0 draft
        nothing. No model has seen the buffer at ``start`` or later."""
        B, dev = start.shape[0], start.device
        R = min(self.max_len, self.m1_max) if self.m2 is not None else self.max_len
        toks = torch.full((B, R), PAD, dtype=torch.long, device=dev)
        ent, logp = torch.zeros((B, R), device=dev), torch.zeros((B, R), device=dev)
        dists, n = [], torch.zeros(B, dtype=torch.long, device=dev)
        going = room > 0
        for i in range(R):
            going = going & (room > i)
            if i and not bool(going.any()):  # host read: every row stopped
                break
            end = start + n
            lg = self.m1.logits(self._buf, end, end - 1, going)[:, 0].to(
                dev
            )  # [B, V] after each row's last token
            p = _draft_probs(lg, samp)
            h = entropy(p)  # [B]
            if i > 0:
                going = going & ~self.tau1.exceeds(h)
            t = torch.where(going, _draw(p, greedy_tokens(lg), samp), PAD)
            toks[:, i], ent[:, i] = t, h
            lq = p.gather(1, t.clamp_min(0)[:, None])[:, 0].clamp_min(1e-30).log()
            logp[:, i] = torch.where(going, lq, torch.zeros_like(lq))
            if not samp.all_greedy:
                dists.append(p)
            self._write(end, t, going)
            n = n + going.long()
        r = max(1, int(n.max()))  # host read: the columns some row drafted
        return _Chain(
            toks[:, :r], ent[:, :r], logp[:, :r], torch.stack(dists[:r], 1) if dists else None, n
        )

    def _hierarchy(self, L: torch.Tensor, samp: RowSampling, counts: torch.Tensor):
        """Rounds of M1 drafting and M2 pre-verifying for every row until M2 loses confidence
        (or the chain is full). Returns the chains ``(tokens, entropies, logp) [B, max_len]``
        and their lengths ``[B]``; ``counts`` gets [M1 drafted, M2 accepted of them, M2 kept]."""
        B, dev, ML = L.shape[0], L.device, self.max_len
        width = ML + self.m1_max + 1  # scatter room: a round writes at most m1_max + 1 past out
        chain = torch.full((B, width), PAD, dtype=torch.long, device=dev)
        chain_ent, chain_logp = (
            torch.zeros((B, width), device=dev),
            torch.zeros((B, width), device=dev),
        )
        out = torch.zeros(B, dtype=torch.long, device=dev)  # chain tokens so far
        active = torch.ones(B, dtype=torch.bool, device=dev)
        greedy_row = (samp.temperature <= 0).to(dev)
        while True:
            start = L + out
            room = torch.where(active, (ML - out).clamp(max=self.m1_max), torch.zeros_like(out))
            c1 = self._m1_chain(start, room, samp)
            R = c1.tokens.shape[1]
            ar, ar1 = cached_arange(R, dev), cached_arange(R + 1, dev)
            # one M2 forward per round: its distributions after start-1 .. start+n1-1   [B, R+1, V]
            lg2 = self.m2.logits(self._buf, start + c1.n, start - 1, active).to(dev)
            p2 = _draft_probs(lg2, samp)
            h2 = entropy(p2)  # [B, R+1]
            g2 = greedy_tokens(lg2)  # [B, R+1]
            n_ok = _preverified(c1, p2, g2, samp, greedy_row, ar)  # [B]
            rejected = active & (n_ok < c1.n)
            self.tau1.reject_where(rejected, c1.ent.gather(1, n_ok.clamp(max=R - 1)[:, None])[:, 0])
            extra = _m2_token(c1, p2, g2, n_ok, rejected, samp)
            cand = torch.where(
                ar1 < n_ok[:, None],
                torch.cat([c1.tokens, c1.tokens[:, :1]], 1),
                torch.where(ar1 == n_ok[:, None], extra[:, None], PAD),
            )  # [B, R+1]
            c_len = n_ok + 1
            # M2's self-verify: keep candidates while M2's entropy stays under tau2 (the chain's
            # first token always)
            unsure = (
                ((ar1 > 0)[None] | (out > 0)[:, None])
                & self.tau2.exceeds(h2)
                & (ar1[None] < c_len[:, None])
            )
            confident = ~unsure.any(dim=1)
            keep = torch.where(confident, c_len, unsure.long().argmax(dim=1))
            keep = torch.where(active, torch.minimum(keep, ML - out), torch.zeros_like(keep))
            # the correction goes into the buffer; what follows it is forgotten by both models
            self._write(start + n_ok, extra, active)
            cut = torch.where(
                active, start + n_ok, torch.full_like(start, torch.iinfo(torch.long).max)
            )
            for m in self.models:
                m.truncate(cut)
            pos = out[:, None] + ar1  # [B, R+1] chain positions of the candidates
            sel = ar1[None] < keep[:, None]
            lp2 = p2.gather(2, cand.clamp_min(0)[:, :, None])[:, :, 0].clamp_min(1e-30).log()
            for dst, src in ((chain, cand), (chain_ent, h2), (chain_logp, lp2)):
                dst.scatter_(1, pos, torch.where(sel, src, dst.gather(1, pos)))
            counts += torch.stack([c1.n.sum(), n_ok.sum(), keep.sum()])
            out = out + keep
            active = active & confident & (keep == c_len) & (out < ML)
            if not bool(active.any()):  # host read: every chain is done
                break
        return chain[:, :ML], chain_ent[:, :ML], chain_logp[:, :ML], out

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Draft:
        """One chain per row: ``Draft(tokens [B, 1, L], logp [B, 1, L])`` (``logp``: the final
        level's log-probability of each token; ``L`` the longest chain)."""
        t0 = time.perf_counter()
        B, dev = state.batch_size, state.device
        if self._buf is None or self._buf.shape[0] != B:
            raise ConfigError(
                f"HSDDW holds {0 if self._buf is None else self._buf.shape[0]} rows, the state "
                f"{B}: call add_rows(state, start) when rows join (the decoder does)."
            )
        samp = state.sampling if state.sampling is not None else RowSampling.uniform(B, device=dev)
        calls = [m.calls for m in self.models]
        self._sync(state)
        counts = torch.zeros(3, dtype=torch.long, device=dev)
        if self.m2 is None:
            c = self._m1_chain(state.lengths, torch.full((B,), self.max_len, device=dev), samp)
            toks, ent, logp, n = c.tokens, c.ent, c.logp, c.n
            counts[0] += n.sum()
        else:
            toks, ent, logp, n = self._hierarchy(state.lengths, samp, counts)
        drafted1, accepted1, kept2, longest = torch.cat(
            [counts, n.max()[None]]
        ).tolist()  # one host read
        self._ent, self._len = ent, n
        lv = self.stats.levels
        lv[self.m1.name].drafted += drafted1
        if self.m2 is not None:
            lv[self.m1.name].accepted += accepted1
            lv[self.m2.name].drafted += kept2
        for m, c0 in zip(self.models, calls):
            self.stats.model_calls[m.name] = self.stats.model_calls.get(m.name, 0) + m.calls - c0
        L = max(1, longest)
        self.stats.draft_seconds += time.perf_counter() - t0
        return Draft(tokens=toks[:, None, :L].contiguous(), logp=logp[:, None, :L].contiguous())

    def observe(self, state: DecodeState, draft: Draft, feedback: Feedback) -> None:
        """The target's verdict: the first rejected chain token feeds the last level's tau.

        The chain token after the accepted prefix counts as rejected only when it was verified
        (``feedback.verified``: the decoder's node budget may have cut it from the tree).
        """
        a = feedback.accepted_prefix[:, 0].to(self._len.device)  # [B] accepted tokens of the chain
        n = self._len
        rejected = (a < n) & (a < feedback.verified[:, 0].to(n.device))
        thr = self.tau2 if self.m2 is not None else self.tau1
        thr.reject_where(
            rejected, self._ent.gather(1, a.clamp(max=self._ent.shape[1] - 1)[:, None])[:, 0]
        )
        top = self.models[-1]
        acc, emitted = torch.stack(
            [torch.minimum(a, n).sum(), (feedback.num_accepted.to(n.device) + 1).sum()]
        ).tolist()
        self.stats.levels[top.name].accepted += acc
        self.stats.target_calls += state.batch_size
        self.stats.output_tokens += emitted


def default_hierarchy(
    target,
    m1_layers: int | None = None,
    m2_layers: int | None = None,
    vocab_subset: torch.Tensor | None = None,
    **kw,
) -> HSDDWDrafter:
    """The no-training hierarchy of any target: early-exit(~L/8) -> early-exit(~L/2.5) -> target
    (4 and 12 layers for a 30-layer SmolLM2), sharing the target's weights. ``vocab_subset``:
    compute both draft heads over these token ids only (see :class:`CausalLMModel`)."""
    n = int(target.model.config.num_hidden_layers)
    l1 = m1_layers or max(1, round(n / 8))
    l2 = m2_layers or max(l1 + 1, round(n / 2.5))
    V = target.vocab_size
    m2 = (
        None
        if l2 >= n
        else CausalLMModel(early_exit_model(target.model, l2), f"ee{l2}", V, vocab_subset)
    )
    return HSDDWDrafter(
        CausalLMModel(early_exit_model(target.model, l1), f"ee{l1}", V, vocab_subset), m2, **kw
    )
