"""HSDDW (Syu & Lee 2025): entropy self-verify and hierarchical pre-verification of drafts.

* **Self-verify.** A draft model stops drafting when the entropy of its next-token distribution
  exceeds ``tau``; ``tau`` is the running mean of the entropies of the draft tokens its verifier
  rejected so far in this request, starting at 0 (:class:`EntropyThreshold`). The first token of
  a chain is always drafted (with ``tau = 0`` every later one would stop the chain).
* **Draft models.** Anything that gives next-token distributions over the target vocab
  (:class:`ProbModel`): any causal LM that shares the target's tokenizer (:class:`CausalLMModel`),
  an *early-exit* draft cut from the target itself (:func:`early_exit_model`: its first ``L``
  layers, final norm and head, sharing the weights, so no extra memory), or the tri-gram table
  (:class:`TrigramModel`). Every target therefore has a hierarchy with no training.
* **Hierarchy.** M1 drafts with self-verify; M2 pre-verifies M1's tokens by rejection sampling
  (one M2 forward over the chain), keeps its own correction token, and hands the chain back to
  M1 to extend while M2's entropy stays under M2's own ``tau``; when M2 loses confidence the
  chain goes to the target (:class:`HSDDWDrafter`). Because M2's rejection sampling makes every
  emitted token a sample of M2's distribution, the draft's ``q`` is M2's distribution and the
  decoder's rejection sampling against the target stays lossless; in greedy decoding the chain
  is M2's greedy chain.
* **Stats** (:class:`HierarchyStats`): redundancy ``sigma = 1 - accepted / drafted`` per level
  and target utilisation ``eta = target calls / output length``.

Draft models keep their own KV cache per request row and re-sync it with the committed tokens
by cropping to the common prefix (no re-prefill of what they already saw).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from redraft.errors import ConfigError
from redraft.infer.drafters.base import PAD, DecodeState, Draft, Drafter, Feedback
from redraft.ngrams import as_trigram_table


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of ``[..., V]`` probabilities: ``[...]``."""
    p = probs.float()
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


class EntropyThreshold:
    """Per-request ``tau``: the running mean entropy of rejected draft tokens, starting at ``init``.

    ``tau[b] = mean(entropies of the draft tokens rejected so far in row b)``, ``init`` (0 by
    default) before any rejection. :meth:`stop` says whether a draft model must stop before a
    token whose distribution has entropy ``H``: ``H > tau``.
    """

    def __init__(self, batch_size: int, init: float = 0.0):
        self.init = float(init)
        self.total = torch.zeros(batch_size, dtype=torch.float64)
        self.count = torch.zeros(batch_size, dtype=torch.long)

    @property
    def tau(self) -> torch.Tensor:
        """``[B]`` float64 thresholds."""
        return torch.where(self.count > 0, self.total / self.count.clamp_min(1),
                           torch.full_like(self.total, self.init))

    def stop(self, row: int, h: float) -> bool:
        return h > float(self.tau[row])

    def reject(self, rows, entropies) -> None:
        """Record rejected draft tokens: rows ``[n]`` and the entropies they were drafted at."""
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        ent = torch.as_tensor(entropies, dtype=torch.float64).reshape(-1)
        self.total.index_add_(0, rows, ent)
        self.count.index_add_(0, rows, torch.ones_like(rows))

    def select_rows(self, keep) -> None:
        keep = torch.as_tensor(keep, dtype=torch.long).cpu()
        self.total, self.count = self.total[keep], self.count[keep]

    def add_rows(self, n: int) -> None:
        self.total = torch.cat([self.total, torch.zeros(n, dtype=torch.float64)])
        self.count = torch.cat([self.count, torch.zeros(n, dtype=torch.long)])


# ---------------------------------------------------------------------------------- draft models


def early_exit_model(model: nn.Module, num_layers: int) -> nn.Module:
    """A causal LM made of ``model``'s first ``num_layers`` decoder layers, final norm and head.

    Shares every weight with ``model`` (no copy: parameters are the same tensors), so it costs no
    memory; it has its own config (``num_hidden_layers = num_layers``) and therefore its own KV
    cache. Works for transformers decoder-only models whose base model keeps its layers in
    ``.layers`` (Llama, Mistral, Qwen2/3, Gemma, Phi-3, SmolLM, ...).
    """
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(
            f"early exit needs a decoder whose layers are `{prefix}.layers` (Llama-style); "
            f"{type(model).__name__} has none. Use a separate draft LM instead.")
    n = len(layers)
    if not 1 <= num_layers < n:
        raise ConfigError(f"early-exit layers={num_layers}: choose 1..{n - 1} for a {n}-layer target.")
    cfg = copy.copy(model.config)
    cfg.num_hidden_layers = num_layers
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = list(cfg.layer_types[:num_layers])
    new_base = copy.copy(base)  # shallow: same parameters, own module table
    new_base._modules = type(base._modules)(base._modules)
    new_base._modules["layers"] = nn.ModuleList(list(layers[:num_layers]))
    new_base.config = cfg
    new = copy.copy(model)
    new._modules = type(model._modules)(model._modules)
    new._modules[prefix] = new_base
    new.config = cfg
    return new


class ProbModel:
    """A draft model as HSDDW needs it: next-token distributions for one request row at a time.

    Subclasses implement :meth:`logits` and may keep per-row state (KV caches).
    """

    name = "model"

    def reset(self, batch_size: int) -> None:
        """A new batch of requests."""

    def add_rows(self, n: int) -> None:
        """``n`` new request rows join after the current ones."""

    def select_rows(self, keep: list[int]) -> None:
        """Rows ``keep`` stay (renumbered), the others' state is dropped."""

    def logits(self, row: int, context: list[int], extra: list[int]) -> torch.Tensor:
        """Next-token logits after ``context + extra[:i]`` for ``i = 0..len(extra)``:
        ``[len(extra) + 1, V]`` float (one forward over ``extra`` for an LM)."""
        raise NotImplementedError


class CausalLMModel(ProbModel):
    """Any causal LM sharing the target's tokenizer (a small LM, or :func:`early_exit_model`).

    Keeps one ``DynamicCache`` per row holding the tokens it has seen; each call crops it to the
    prefix it shares with the new context and feeds only the rest.

    Args:
        model: the causal LM.
        name: stats label.
        vocab_size: pad (or cut) its logits to this many ids (the target's vocab).
        vocab_subset: ``[S]`` token ids: compute the head over these rows only (the head of a
            small model is most of its cost: 49152 x 576 for SmolLM2, 8 decoder layers' worth of
            weights), every other token gets probability 0. Its distribution stays a valid
            ``q`` for lossless rejection sampling. Costs a copy of ``S`` head rows.
    """

    def __init__(self, model: nn.Module, name: str = "lm", vocab_size: int | None = None,
                 vocab_subset: torch.Tensor | None = None):
        self.model = model.eval()
        self.name = name
        self.vocab_size = vocab_size
        self.caches: list = []
        self.seen: list[list[int]] = []
        self.forwards = 0
        self.subset = None
        if vocab_subset is not None:
            head = model.get_output_embeddings()
            self.subset = torch.as_tensor(vocab_subset, dtype=torch.long, device=head.weight.device)
            self.sub_w = head.weight.detach()[self.subset].contiguous()  # [S, H]
            self.sub_b = None if head.bias is None else head.bias.detach()[self.subset]
            self.base = getattr(model, model.base_model_prefix)
            self.full_v = vocab_size or head.weight.shape[0]

    def reset(self, batch_size: int) -> None:
        self.caches = [None] * batch_size
        self.seen = [[] for _ in range(batch_size)]

    def add_rows(self, n: int) -> None:
        self.caches += [None] * n
        self.seen += [[] for _ in range(n)]

    def select_rows(self, keep: list[int]) -> None:
        self.caches = [self.caches[i] for i in keep]
        self.seen = [self.seen[i] for i in keep]

    @torch.no_grad()
    def logits(self, row: int, context: list[int], extra: list[int]) -> torch.Tensor:
        from transformers import DynamicCache

        full = list(context) + list(extra)
        seen = self.seen[row]
        n = min(len(seen), len(context) - 1)  # the last context token is always fed: its logits
        common = next((i for i in range(n) if seen[i] != full[i]), n)
        cache = self.caches[row]
        if cache is None or common == 0:
            cache, common = DynamicCache(config=self.model.config), 0
        elif cache.get_seq_length() > common:
            cache.crop(common - cache.get_seq_length())  # negative: drop that many (all versions)
        dev = next(self.model.parameters()).device
        ids = torch.tensor([full[common:]], dtype=torch.long, device=dev)
        pos = torch.arange(common, len(full), device=dev)[None]
        first = len(context) - 1 - common  # fed position of the context's last token
        self.forwards += 1
        if self.subset is not None:
            h = self.base(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).last_hidden_state
            sub = h[0, first:] @ self.sub_w.T  # [len(extra)+1, S]
            if self.sub_b is not None:
                sub = sub + self.sub_b
            logits = sub.new_full((sub.shape[0], self.full_v), float("-inf"))
            logits[:, self.subset] = sub
        else:
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
            logits = out.logits[0, first:]  # [len(extra)+1, V']
        self.caches[row], self.seen[row] = cache, full
        logits = logits.float()
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            pad = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            m = min(self.vocab_size, logits.shape[-1])
            pad[:, :m] = logits[:, :m]
            logits = pad
        return logits


def frequent_tokens(docs, vocab_size: int, n: int) -> torch.Tensor:
    """The ``n`` most frequent token ids of ``docs`` (token id lists), for ``vocab_subset``."""
    counts = np.zeros(vocab_size, np.int64)
    for d in docs:
        counts += np.bincount(np.asarray(d, np.int64), minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[:n]))


class TrigramModel(ProbModel):
    """The tri-gram table as a draft distribution: ``P(. | w1, w2)`` over its top-k successors
    (the rest of the vocabulary has probability 0; an unknown context gives a uniform-free
    'no idea' distribution of maximal entropy so self-verify stops there)."""

    def __init__(self, table, vocab_size: int, top_k: int = 12, name: str = "trigram"):
        self.table = as_trigram_table(table)
        self.V, self.k, self.name = vocab_size, top_k, name

    def logits(self, row: int, context: list[int], extra: list[int]) -> torch.Tensor:
        full = list(context) + list(extra)
        n = len(extra) + 1
        w1 = np.array([full[len(context) - 2 + i] if len(context) - 2 + i >= 0 else -1 for i in range(n)])
        w2 = np.array(full[len(context) - 1: len(context) - 1 + n])
        ids, probs = self.table.successors(w1, w2, self.k)  # [n, k]
        out = torch.full((n, self.V), float("-inf"))
        mass = probs.sum(1, keepdims=True)
        p = torch.from_numpy(np.where(mass > 0, probs / np.maximum(mass, 1e-12), 0.0)).float()
        ok = torch.from_numpy(ids >= 0)
        rows = torch.arange(n)[:, None].expand_as(ok)
        out[rows[ok], torch.from_numpy(ids)[ok]] = p[ok].log()
        out[torch.from_numpy(mass[:, 0] <= 0)] = 0.0  # unknown context: uniform (max entropy)
        return out


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
    """HSDDW's statistics for one batch: per level redundancy, target utilisation, time."""

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
        return {"eta": self.eta, "target_calls": self.target_calls, "output_tokens": self.output_tokens,
                "draft_seconds": self.draft_seconds,
                "levels": {k: {"drafted": v.drafted, "accepted": v.accepted, "sigma": v.sigma}
                           for k, v in self.levels.items()}}


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        return logits.float().softmax(-1)
    return (logits.float() / temperature).softmax(-1)


class HSDDWDrafter(Drafter):
    """One chain per row from M1 (self-verify), pre-verified and extended by M2 when given.

    Args:
        m1: the fast draft model (:class:`ProbModel`, or an ``nn.Module`` causal LM).
        m2: the stronger draft model that pre-verifies M1's tokens, or ``None`` (M1 alone, its
            ``tau`` learning from the target's rejections).
        max_len: tokens per chain at most.
        m1_max: tokens M1 drafts per round before M2 checks them.
        tau_init: starting ``tau`` of both levels (the paper: 0).
        name: stats label.
    """

    def __init__(self, m1, m2=None, max_len: int = 8, m1_max: int = 4, tau_init: float = 0.0,
                 name: str = "hsddw"):
        self.m1 = m1 if isinstance(m1, ProbModel) else CausalLMModel(m1, "m1")
        self.m2 = None if m2 is None else (m2 if isinstance(m2, ProbModel) else CausalLMModel(m2, "m2"))
        self.max_len, self.m1_max, self.tau_init = max_len, m1_max, tau_init
        self.name = name
        self.tau1 = EntropyThreshold(0, tau_init)
        self.tau2 = EntropyThreshold(0, tau_init)
        self.stats = HierarchyStats()
        self._last_ent: list[list[float]] = []  # per row: entropy of the final level at each chain token

    # ------------------------------------------------------------------ life cycle

    def add_rows(self, state: DecodeState, start: int) -> None:
        B, n = state.batch_size, state.batch_size - start
        if start == 0:
            self.m1.reset(0)
            if self.m2 is not None:
                self.m2.reset(0)
            self.tau1, self.tau2 = EntropyThreshold(0, self.tau_init), EntropyThreshold(0, self.tau_init)
            levels = {self.m1.name: LevelStats()}
            if self.m2 is not None:
                levels[self.m2.name] = LevelStats()
            self.stats = HierarchyStats(levels=levels)
        self.m1.add_rows(n)
        if self.m2 is not None:
            self.m2.add_rows(n)
        self.tau1.add_rows(n)
        self.tau2.add_rows(n)

    def select_rows(self, keep: torch.Tensor) -> None:
        k = keep.tolist()
        self.m1.select_rows(k)
        if self.m2 is not None:
            self.m2.select_rows(k)
        self.tau1.select_rows(keep)
        self.tau2.select_rows(keep)

    # ------------------------------------------------------------------ drafting

    def _m1_chain(self, row: int, ctx: list[int], temp: float, gen, room: int):
        """M1 drafts up to ``room`` tokens, stopping when its entropy exceeds tau1 (the first
        token always). Returns tokens, their entropies, and the distributions they came from."""
        toks, ents, dists = [], [], []
        for i in range(room):
            p = _probs(self.m1.logits(row, ctx + toks, [])[-1], temp)
            h = float(entropy(p))
            if i > 0 and self.tau1.stop(row, h):
                break
            t = int(p.argmax()) if temp <= 0 else int(torch.multinomial(p, 1, generator=gen))
            toks.append(t)
            ents.append(h)
            dists.append(p)
        return toks, ents, dists

    def _draft_row(self, row: int, ctx: list[int], temp: float, gen):
        """One chain for one row: ``(tokens, entropies of the final level, q per token)``."""
        if self.m2 is None:
            toks, ents, dists = self._m1_chain(row, ctx, temp, gen, self.max_len)
            self.stats.levels[self.m1.name].drafted += len(toks)
            return toks, ents, dists
        out, out_ent, out_q = [], [], []
        lv1, lv2 = self.stats.levels[self.m1.name], self.stats.levels[self.m2.name]
        while len(out) < self.max_len:
            room = min(self.m1_max, self.max_len - len(out))
            t1, e1, q1 = self._m1_chain(row, ctx + out, temp, gen, room)
            lv1.drafted += len(t1)
            p2 = _probs(self.m2.logits(row, ctx + out, t1), temp)  # [n+1, V]: one M2 forward
            h2 = entropy(p2).tolist()
            n_ok, extra = 0, None
            for i, t in enumerate(t1):  # rejection sampling of M1's tokens under M2
                if temp <= 0:
                    ok = int(p2[i].argmax()) == t
                else:
                    ok = float(torch.rand((), generator=gen)) < min(1.0, float(p2[i, t] / q1[i][t].clamp_min(1e-30)))
                if not ok:
                    self.tau1.reject([row], [e1[i]])
                    if temp <= 0:
                        extra = int(p2[i].argmax())
                    else:
                        res = (p2[i] - q1[i]).clamp_min(0)
                        res = res / res.sum() if float(res.sum()) > 0 else p2[i]
                        extra = int(torch.multinomial(res, 1, generator=gen))
                    break
                n_ok += 1
            lv1.accepted += n_ok
            if extra is None:  # all of M1's tokens passed: M2 adds its own next token
                i = len(t1)
                extra = int(p2[i].argmax()) if temp <= 0 else int(torch.multinomial(p2[i], 1, generator=gen))
            cand = t1[:n_ok] + [extra]
            # M2's self-verify: keep tokens while M2's entropy stays under tau2 (first one always)
            keep, confident = 0, True
            for i in range(len(cand)):
                if (out or i > 0) and self.tau2.stop(row, h2[i]):
                    confident = False
                    break
                keep += 1
            keep = min(keep, self.max_len - len(out))
            out += cand[:keep]
            out_ent += h2[:keep]
            out_q += [p2[i] for i in range(keep)]
            lv2.drafted += keep
            if not confident or keep < len(cand):
                break
        return out, out_ent, out_q

    @torch.no_grad()
    def propose(self, state: DecodeState) -> Draft:
        """One chain per row: ``Draft(tokens [B, 1, L], logp, q)`` (``q`` when sampling)."""
        t0 = time.perf_counter()
        sampling = state.sampling
        temp = float(sampling.temperature.max()) if sampling is not None else 0.0
        gen = sampling.generators[0] if sampling is not None and sampling.generators else None
        B = state.batch_size
        toks = state.tokens.tolist()
        lens = state.lengths.tolist()
        chains, ents, qs = [], [], []
        for r in range(B):
            c, e, q = self._draft_row(r, toks[r][: lens[r]], temp, gen)
            chains.append(c)
            ents.append(e)
            qs.append(q)
        self._last_ent = ents
        L = max(1, max(len(c) for c in chains))
        tokens = torch.full((B, 1, L), PAD, dtype=torch.long)
        logp = torch.zeros((B, 1, L))
        for r, (c, q) in enumerate(zip(chains, qs)):
            if not c:
                continue
            tokens[r, 0, : len(c)] = torch.tensor(c)
            qq = torch.stack(q)  # [n, V]
            logp[r, 0, : len(c)] = qq[torch.arange(len(c)), torch.tensor(c)].clamp_min(1e-30).log()
        self.stats.draft_seconds += time.perf_counter() - t0
        dev = state.device
        return Draft(tokens=tokens.to(dev), logp=logp.to(dev))

    def observe(self, state: DecodeState, draft: Draft, feedback: Feedback) -> None:
        """The target's verdict: the first rejected chain token feeds the last level's tau.

        The chain token after the accepted prefix counts as rejected only when it was verified
        (``feedback.verified``: the decoder's node budget may have cut it from the tree).
        """
        a = feedback.accepted_prefix[:, 0].tolist()  # [B] accepted tokens of the chain
        verified = feedback.verified[:, 0].tolist()
        top = self.m2 if self.m2 is not None else self.m1
        thr = self.tau2 if self.m2 is not None else self.tau1
        rows, ents = [], []
        for r, (n_ok, e) in enumerate(zip(a, self._last_ent)):
            if n_ok < len(e) and n_ok < verified[r]:
                rows.append(r)
                ents.append(e[n_ok])
        if rows:
            thr.reject(rows, ents)
        self.stats.levels[top.name].accepted += int(sum(min(n, len(e)) for n, e in zip(a, self._last_ent)))
        self.stats.target_calls += state.batch_size
        self.stats.output_tokens += int((feedback.num_accepted + 1).sum())


def default_hierarchy(target, m1_layers: int | None = None, m2_layers: int | None = None,
                      vocab_subset: torch.Tensor | None = None, **kw) -> HSDDWDrafter:
    """The no-training hierarchy of any target: early-exit(~L/8) -> early-exit(~L/2.5) -> target
    (4 and 12 layers for a 30-layer SmolLM2), sharing the target's weights. ``vocab_subset``:
    compute both draft heads over these token ids only (see :class:`CausalLMModel`)."""
    n = int(target.model.config.num_hidden_layers)
    l1 = m1_layers or max(1, round(n / 8))
    l2 = m2_layers or max(l1 + 1, round(n / 2.5))
    V = target.vocab_size
    m2 = None if l2 >= n else CausalLMModel(early_exit_model(target.model, l2), f"ee{l2}", V, vocab_subset)
    return HSDDWDrafter(CausalLMModel(early_exit_model(target.model, l1), f"ee{l1}", V, vocab_subset), m2, **kw)


def bench_methods(target=None, mix=()):
    """Methods this module adds to ``redraft-bench``: the early-exit hierarchy alone
    (``"hsddw"``), M1 with self-verify alone (``"hsddw-m1"``), and the hierarchy added to the
    unified mix (``"mix+hsddw"``)."""
    if target is None:
        return {}
    out = {"hsddw": [default_hierarchy(target)],
           "hsddw-m1": [default_hierarchy(target, m2_layers=10 ** 6)]}
    if mix:
        out["mix+hsddw"] = list(mix) + [default_hierarchy(target)]
    return out
