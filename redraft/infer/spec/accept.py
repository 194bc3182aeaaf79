"""Acceptance over a verified draft tree: greedy, lossless rejection sampling, typical.

A rule reads the target's logits at every node (``logits[b, n]`` is the target's next-token
distribution *after* node n) and picks the accepted path (root first) and the bonus token the
target contributes after it. The step splits that in two: on the device,
:func:`step_choices` gives every node the token(s) the rule takes after it (the step's one
read); on the host, :func:`walk` follows them down the tree the host built
(:class:`HostAcceptance`). The rules as whole torch functions of the tree and the logits are
the tests' oracle (tests/reference/accept.py).

* greedy: a node is correct iff its token is the target's argmax after its parent; the deepest
  node whose whole ancestry is correct wins. Output equals plain greedy decoding.
* rejection: recursive rejection sampling over siblings (SpecInfer's multi-step speculative
  sampling) with deterministic drafts (every candidate a point mass, whatever proposed it). At a
  node with target distribution p and children tokens t_1..t_k, child i is accepted with
  probability ``p(t_i) / (1 - p(t_1) - ... - p(t_{i-1}))`` after its elder siblings were
  rejected, and when all are rejected the bonus is drawn from p without them. The chance of
  child i is therefore exactly ``p(t_i)`` and of bonus x (not a child) exactly ``p(x)``: the
  same as drawing one x ~ p and moving to the child whose token is x if there is one (siblings
  hold distinct tokens after deduplication). So the rule is: draw ``x[n] ~ p(. | n)`` at every
  node, and accept the deepest node whose every ancestor-child step matches the draws, i.e.
  greedy acceptance with sampled tokens in place of the argmax. The emitted tokens follow the
  target's (temperature/top-p warped) distribution exactly; a draw at a node the walk never
  reaches is simply unused. Drafts' own probabilities are never needed (a draft that *sampled*
  its tokens is verified as point masses too, which is lossless as well).
* typical (Medusa): a node is accepted when ``p(t) > min(eps, delta * exp(-H(p)))`` under its
  parent's distribution; the deepest fully accepted node wins; the bonus is the argmax (greedy)
  or a sample (temperature > 0) from the last node's distribution. Not lossless.

Sampling settings are per row (:class:`RowSampling`), so requests with different temperatures,
top-p and seeds share one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from redraft.infer.config import TYPICAL_DELTA, TYPICAL_EPS
from redraft.infer.spec import hostjit


class RowSampling:
    """Per-row sampling settings of a batch, with host-side flags so no step reads the device.

    Args:
        temperature: per row (0 = greedy), a list or a tensor.
        top_p: per row, in (0, 1].
        generators: per row, the ``torch.Generator`` its random draws come from (``None``: the
            global one). Rows sharing a generator draw in one call.
        device: where the tensors live.
        uniforms: per row ``None`` or a 1-D tensor: the row's own random numbers, one per output
            token (a request with a ``seed``). Its ``i``-th output token is drawn by inverse CDF
            with ``uniforms[i]``, wherever in a tree it is drawn: the row's samples then depend on
            nothing but its seed and its own logits (not on the other rows of the batch, nor on
            the drafts), and equal plain autoregressive sampling with the same uniforms.

        top_k, min_p: per row (0: off), applied with the temperature (see :func:`warp_probs`).
        logprobs: per row ``None`` or the number of alternatives whose log-probabilities the
            row wants with each output token.

    Attributes:
        offset: ``[B]`` long on the device, the output tokens each row has so far (the index of
            the next token's uniform); the engine sets it every step.
        proc: the step's :class:`~redraft.infer.engine.processors.RowProcessors` (penalties, bias,
            min_tokens) or ``None``; the engine sets it every step for rows that use them.
    """

    def __init__(
        self,
        temperature,
        top_p,
        generators=None,
        device=None,
        uniforms=None,
        top_k=None,
        min_p=None,
        logprobs=None,
    ):
        t = (
            temperature.tolist()
            if isinstance(temperature, torch.Tensor)
            else [float(x) for x in temperature]
        )
        p = top_p.tolist() if isinstance(top_p, torch.Tensor) else [float(x) for x in top_p]
        self.temperature = torch.tensor(t, dtype=torch.float32, device=device)  # [B]
        self.top_p = torch.tensor(p, dtype=torch.float32, device=device)  # [B]
        k = [int(x) if y > 0 else 0 for x, y in zip(top_k or [0] * len(t), t)]
        m = [float(x) if y > 0 else 0.0 for x, y in zip(min_p or [0.0] * len(t), t)]
        self.top_k_max = max(k, default=0)  # host: 0 when no sampled row has a top_k
        self.top_k = (
            torch.tensor(k, dtype=torch.long, device=device) if self.top_k_max else None
        )  # [B]
        self.min_p = torch.tensor(m, dtype=torch.float32, device=device) if any(m) else None  # [B]
        self.logprobs = list(logprobs) if logprobs else [None] * len(t)
        self.logprob_rows = [r for r, x in enumerate(self.logprobs) if x is not None]
        self.proc = None
        self.all_greedy = all(x <= 0 for x in t)
        self.any_greedy = any(x <= 0 for x in t)
        self.any_top_p = any(x < 1 for x, y in zip(p, t) if y > 0)
        self.generators = list(generators) if generators else [None] * len(t)
        uniforms = list(uniforms) if uniforms else [None] * len(t)
        self.seeded = [r for r, u in enumerate(uniforms) if u is not None and t[r] > 0]
        self.uniforms = None
        if self.seeded:
            width = max(len(uniforms[r]) for r in self.seeded)
            table = torch.full((len(t), width), 0.5, dtype=torch.float64)
            for r in self.seeded:
                table[r, : len(uniforms[r])] = uniforms[r]
            self.uniforms = table.to(device)  # [B, U]
        self.offset = torch.zeros(len(t), dtype=torch.long, device=device)
        self.groups = _by_id(
            self.generators
        )  # every row by generator (drafters that sample use it)
        self._target_groups = _by_id(
            self.generators, skip=set(self.seeded)
        )  # the target's multinomial draws

    @classmethod
    def uniform(
        cls, batch: int, temperature: float = 0.0, top_p: float = 1.0, generator=None, device=None
    ):
        """Every row with the same settings and one shared generator."""
        return cls([temperature] * batch, [top_p] * batch, [generator] * batch, device)


def _by_id(generators: list, skip=()) -> list:
    """``[(generator, [rows using it])]`` in first-use order."""
    groups: dict = {}
    for r, g in enumerate(generators):
        if r not in skip:
            groups.setdefault(id(g), (g, []))[1].append(r)
    return list(groups.values())


def seed_uniforms(seed: int, n: int) -> torch.Tensor:
    """``n`` float64 uniforms in [0, 1) of a request's seed (the same on every machine)."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.rand(n, dtype=torch.float64, generator=gen)


def warp_probs(
    logits: torch.Tensor,
    temperature,
    top_p=1.0,
    top_k: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    top_k_max: int = 0,
) -> torch.Tensor:
    """Target distribution after temperature, ``min_p``, ``top_k`` and nucleus (top-p) warping,
    in that order (vLLM's): ``[B, ..., V]`` probs.

    ``temperature`` and ``top_p`` are floats or ``[B]`` tensors (per row); rows at temperature 0
    are scaled as if at 1e-6 (their result is not used for sampling: callers take the argmax).
    ``min_p [B]`` (0: off) drops tokens less likely than ``min_p`` times the likeliest; ``top_k
    [B]`` (0: off; ``top_k_max`` its largest value, a host int) keeps the k likeliest (ties kept).
    """
    lead = (-1,) + (1,) * (logits.dim() - 1)
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    logits = logits.float() / (t.reshape(lead) if t.dim() else t).clamp_min(1e-6)
    if min_p is not None:  # p < min_p * p_max  <=>  logit < max logit + log(min_p)
        cut = logits.max(dim=-1, keepdim=True).values + min_p.reshape(lead).log()
        logits = logits.masked_fill(logits < cut, float("-inf"))
    if top_k is not None and top_k_max:
        kth = logits.topk(min(top_k_max, logits.shape[-1]), dim=-1).values  # [B, ..., kmax]
        k = (
            (top_k.clamp(1, kth.shape[-1]) - 1).reshape(lead).expand(*kth.shape[:-1], 1)
        )  # [B, ..., 1]
        cut = torch.where(top_k.reshape(lead) > 0, kth.gather(-1, k), float("-inf"))
        logits = logits.masked_fill(logits < cut, float("-inf"))
    per_row = isinstance(top_p, torch.Tensor) and top_p.dim() > 0
    if per_row or float(top_p) < 1.0:  # decided on the host: no device read
        p = torch.as_tensor(top_p, dtype=torch.float32, device=logits.device)
        p = p.reshape(lead) if per_row else p
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = (probs.cumsum(dim=-1) - probs >= p) & (p < 1)  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits.softmax(dim=-1)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of ``[..., V]`` probabilities: ``[...]`` float32 (``entr``:
    ``-p log p``, 0 at 0, in one pass: no clamp and log over the whole vocabulary)."""
    return torch.special.entr(probs.float()).sum(dim=-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim, the first index on ties. ``max().indices`` computes the same as
    ``argmax`` but several times faster for bfloat16 logits on CPU (see docs/infer.md).
    Plain decoding and verification both use this, so their tie rule is the same."""
    return logits.max(dim=-1).indices


def sample_tokens(
    logits: torch.Tensor, rows: RowSampling, depth: torch.Tensor | int = 0
) -> torch.Tensor:
    """One token per row and node from the warped target distribution: ``[B, ...]`` long
    (greedy rows take the argmax). ``logits [B, ..., V]``; ``depth`` (``[B, ...]`` or an int):
    how many output tokens after the row's ``offset`` each draw makes, which picks the uniform
    of a seeded row."""
    greedy = greedy_tokens(logits)
    if rows.all_greedy:
        return greedy
    probs = warp_probs(
        logits,
        rows.temperature,
        rows.top_p if rows.any_top_p else 1.0,
        rows.top_k,
        rows.min_p,
        rows.top_k_max,
    )
    B, V = probs.shape[0], probs.shape[-1]
    dev = probs.device
    out = greedy.clone()
    for gen, idx in rows._target_groups:
        sub = probs if len(idx) == B else probs[torch.tensor(idx, device=dev)]
        draw = torch.multinomial(sub.reshape(-1, V), 1, generator=gen).reshape(sub.shape[:-1])
        if len(idx) == B:
            out = draw
        else:
            out[torch.tensor(idx, device=dev)] = draw
    if rows.seeded:  # inverse CDF with the uniform of the output token each draw would be
        idx = torch.tensor(rows.seeded, device=dev)
        sub = probs[idx]  # [s, ..., V]
        pos = (
            rows.offset[idx].reshape((-1,) + (1,) * (sub.dim() - 2))
            + torch.as_tensor(depth, device=dev)[idx]
            if isinstance(depth, torch.Tensor)
            else rows.offset[idx].reshape((-1,) + (1,) * (sub.dim() - 2)) + depth
        )
        pos = pos.expand(sub.shape[:-1]).clamp(max=rows.uniforms.shape[1] - 1)
        u = rows.uniforms[idx].gather(1, pos.reshape(len(idx), -1)).reshape(sub.shape[:-1])
        cdf = sub.double().cumsum(dim=-1)
        draw = (
            torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1), right=True)
            .squeeze(-1)
            .clamp(max=V - 1)
        )
        out[idx] = draw
    if rows.any_greedy:
        out = torch.where(
            (rows.temperature <= 0).reshape((-1,) + (1,) * (out.dim() - 1)), greedy, out
        )
    return out


# ---------------------------------------------------------------------------------------------
# The decode step's split: the device picks a token after every tree node (one [R, B, N]
# tensor, the step's one read), the host walks the tree it built (numpy) to the accepted path.


@dataclass
class HostAcceptance:
    """The accepted path of every row, on the host (numpy).

    Attributes:
        path: ``[B, D+1]`` node indices of the accepted path, root first, ``-1`` padded.
        num_accepted: ``[B]`` accepted draft tokens (the root not counted).
        last_node: ``[B]`` deepest accepted node.
        bonus: ``[B]`` the token the target produces after the accepted path.
        emitted: per row the accepted draft tokens then the bonus (``list[int]``).
    """

    path: np.ndarray
    num_accepted: np.ndarray
    last_node: np.ndarray
    bonus: np.ndarray
    emitted: list


def step_choices(
    rule: str,
    tokens: torch.Tensor,
    parent: torch.Tensor,
    depth: torch.Tensor,
    logits: torch.Tensor,
    rows: RowSampling,
    eps: float = TYPICAL_EPS,
    delta: float = TYPICAL_DELTA,
) -> torch.Tensor:
    """``[R, B, N]`` long: what the acceptance ``rule`` needs of every node of the packed trees
    ``tokens / parent / depth [B, N]`` given the target's ``logits [B, N, V]`` after each node
    (processed already: :func:`processed_logits`).

    * greedy: ``R = 1``, the argmax after each node;
    * rejection: ``R = 1``, one draw from the warped target distribution after each node (greedy
      rows: the argmax), seeded rows with the uniform of the output token the draw would be;
    * typical: ``R = 3``: whether each node passes the typical test under its parent's
      distribution (0/1), the argmax after each node, a draw after each node (the bonus).
    """
    if rule == "greedy" or (rule == "rejection" and rows.all_greedy):
        return greedy_tokens(logits)[None]
    if rule == "rejection":
        return sample_tokens(logits, rows, depth)[None]
    temp = torch.where(rows.temperature > 0, rows.temperature, torch.ones_like(rows.temperature))
    probs = warp_probs(logits, temp)  # [B, N, V]
    ent = -(probs * probs.clamp_min(1e-20).log()).sum(dim=-1)  # [B, N]
    thresh = torch.minimum(torch.full_like(ent, eps), delta * torch.exp(-ent))
    par = parent.clamp_min(0)
    p_tok = probs.gather(1, par[:, :, None].expand_as(probs)).gather(
        2, tokens.clamp_min(0)[:, :, None]
    )[:, :, 0]
    ok = (p_tok > thresh.gather(1, par)).long()
    return torch.stack([ok, greedy_tokens(logits), sample_tokens(logits, rows, depth)])


def processed_logits(
    logits: torch.Tensor,
    rows: RowSampling,
    anc: torch.Tensor | None = None,
    depth: torch.Tensor | None = None,
) -> torch.Tensor:
    """``logits [B, N, V]`` with the rows' penalties, bias and ``min_tokens`` applied
    (``rows.proc``; unchanged when no row uses them)."""
    return logits if rows.proc is None else rows.proc.apply(logits, anc, depth)


def logprob_table(
    logits: torch.Tensor,
    pick: torch.Tensor,
    parent: torch.Tensor,
    tokens: torch.Tensor,
    rows: RowSampling,
) -> torch.Tensor | None:
    """What the rows that asked for log-probabilities need, in one tensor (one read):
    ``[L, N, 2 + 2k]`` float32 for rows ``rows.logprob_rows``: per node the log-probability of
    its token after its parent, of the token picked after it (``pick [B, N]``), then the ``k``
    (the largest any row asked) likeliest tokens after it: their log-probabilities and ids.
    Log-probabilities are those of the distribution the token is drawn from (processed logits,
    the row's temperature, min_p / top_k / top_p); greedy rows: the processed logits at
    temperature 1. ``None`` when no row asked."""
    if not rows.logprob_rows:
        return None
    idx = torch.tensor(rows.logprob_rows, device=logits.device)
    sub = logits[idx]  # [L, N, V]
    lead = (-1,) + (1,) * (sub.dim() - 1)
    t = rows.temperature[idx]
    greedy = (t <= 0).reshape(lead)
    top_k = None if rows.top_k is None else rows.top_k[idx]
    min_p = None if rows.min_p is None else rows.min_p[idx]
    warped = warp_probs(
        sub,
        torch.where(t > 0, t, 1.0),
        torch.where(t > 0, rows.top_p[idx], 1.0),
        top_k,
        min_p,
        rows.top_k_max,
    ).log()
    lp = torch.where(greedy, sub.float().log_softmax(dim=-1), warped)  # [L, N, V]
    k = max(rows.logprobs[r] for r in rows.logprob_rows)
    L, N = lp.shape[:2]
    at = lp.gather(
        2, tokens[idx].clamp_min(0)[:, None, :].expand(L, N, N)
    )  # [L, from, to]: to's token after from
    own = at.gather(1, parent[idx].clamp_min(0)[:, None, :])[
        :, 0, :, None
    ]  # [L, N, 1]: after its parent
    picked = lp.gather(2, pick[idx][:, :, None])
    top = lp.topk(k, dim=-1) if k else None
    parts = [own, picked] + ([top.values, top.indices.float()] if k else [])
    return torch.cat(parts, dim=2)


def token_logprobs(
    table: np.ndarray | None,
    rows: RowSampling,
    path: np.ndarray,
    num_accepted: np.ndarray,
    emitted: list,
) -> dict:
    """``{row: [TokenLogprob per emitted token]}`` for the rows that asked, from the host copy
    of :func:`logprob_table`: emitted token i is the node at depth i + 1 of the accepted
    ``path [B, D+1]`` (its log-probability after its parent), the last one the pick after the
    deepest accepted node; alternatives are the top k after the node before it."""
    from redraft.infer.stats import TokenLogprob

    out = {}
    if table is None:
        return out
    K = (table.shape[2] - 2) // 2
    for j, b in enumerate(rows.logprob_rows):
        k, n = rows.logprobs[b], int(num_accepted[b])
        lps = []
        for i, tok in enumerate(emitted[b]):
            at = path[b, i]
            lp = table[j, path[b, i + 1], 0] if i < n else table[j, at, 1]
            top = [
                (int(t), float(v))
                for t, v in zip(table[j, at, 2 + K : 2 + K + k], table[j, at, 2 : 2 + k])
            ]
            lps.append(TokenLogprob(int(tok), float(lp), top))
        out[b] = lps
    return out


def walk(rule: str, tree, choices: np.ndarray) -> HostAcceptance:
    """Accept on the host: the deepest node of the (numpy) ``tree`` whose every ancestor step
    matches the rule (``choices [R, B, N]`` from :func:`step_choices`); ties go to the lower
    node index, as the device rules did."""
    if hostjit.ENABLED:
        path, num, last, bonus, emitted = hostjit.walk(rule, tree, choices)
        return HostAcceptance(
            path=path, num_accepted=num, last_node=last, bonus=bonus, emitted=emitted
        )
    tokens, parent, depth, valid, anc = tree.tokens, tree.parent, tree.depth, tree.valid, tree.anc
    B, N = tokens.shape
    pick = choices[1] if rule == "typical" else choices[0]  # the token followed after each node
    ok = tokens == np.take_along_axis(pick, np.maximum(parent, 0), axis=1)
    if rule == "typical":
        ok |= choices[0].astype(bool)
    ok[:, 0] = True
    ok &= valid
    rows = np.arange(B)
    if N == 1:
        last = np.zeros(B, np.int64)
    else:
        full = ~(anc & ~ok[:, None, :]).any(axis=2) & valid  # [B, N]
        score = np.where(full, depth * N + (N - 1 - np.arange(N))[None], -1)
        last = score.argmax(axis=1)
    num = depth[rows, last]
    bonus = (choices[2] if rule == "typical" else pick)[rows, last]
    D = int(tree.max_depth) + 1
    path = np.full((B, D), -1, np.int64)
    on = anc[rows, last] if N > 1 else np.ones((B, 1), bool)  # [B, N] the accepted path's nodes
    b_idx, n_idx = np.nonzero(on)
    path[b_idx, depth[b_idx, n_idx]] = n_idx
    # one gather and one tolist for the batch (per-row numpy calls cost ~4 us a row)
    seq = np.take_along_axis(tokens, np.maximum(path[:, 1:], 0), axis=1).tolist()
    emitted = [s[:n] + [t] for s, n, t in zip(seq, num.tolist(), bonus.tolist())]
    return HostAcceptance(path=path, num_accepted=num, last_node=last, bonus=bonus, emitted=emitted)
