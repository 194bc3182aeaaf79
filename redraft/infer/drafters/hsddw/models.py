"""HSDDW's draft models: anything that gives next-token distributions over the target vocabulary
for a batch of rows (:class:`ProbModel`): a causal LM that shares the target's tokenizer
(:class:`CausalLMModel`, one batched KV cache), an *early-exit* draft cut from the target itself
(:func:`early_exit_model`: its first ``L`` layers, final norm and head, sharing the weights, so
no extra memory), or the tri-gram table (:class:`TrigramModel`). The drafter that runs them in a
hierarchy is :class:`redraft.infer.drafters.hsddw.drafter.HSDDWDrafter`.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from redraft.errors import ConfigError
from redraft.infer.runner.kv import SlotKVCache
from redraft.infer.spec.paths import cached_arange
from redraft.ngrams import as_trigram_table
from redraft.utils import cache_kwargs

__all__ = ["CausalLMModel", "ProbModel", "TrigramModel", "early_exit_model", "frequent_tokens"]


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
            f"{type(model).__name__} has none. Use a separate draft LM instead."
        )
    n = len(layers)
    if not 1 <= num_layers < n:
        raise ConfigError(
            f"early-exit layers={num_layers}: choose 1..{n - 1} for a {n}-layer target."
        )
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
    """A draft model as HSDDW needs it: next-token logits for a batch of rows at once.

    The drafter holds a token buffer ``tokens [B, W]`` (per row: committed tokens, then the chain
    being drafted) and asks for the logits after some positions of each row. A model may keep
    per-row state about the tokens it has seen (a KV cache); what it has seen of a row is always
    a prefix of that row's buffer, because the drafter calls :meth:`truncate` before it changes
    a token a model may have seen.

    Attributes:
        name: stats label (a level of the hierarchy).
        calls: forwards (or table look-ups) so far, one per :meth:`logits` call.
    """

    name = "model"
    calls = 0

    def reset(self, batch_size: int = 0) -> None:
        """A new batch of ``batch_size`` rows that have seen nothing."""

    def add_rows(self, n: int) -> None:
        """``n`` new rows that have seen nothing join after the current ones."""

    def select_rows(self, keep: torch.Tensor) -> None:
        """Rows ``keep`` (``[B']`` long) stay, renumbered; the others' state is dropped."""

    def truncate(self, lengths: torch.Tensor) -> None:
        """Row ``b`` forgets every token it has seen at positions ``>= lengths[b]`` (``[B]`` long)."""

    def logits(
        self,
        tokens: torch.Tensor,
        end: torch.Tensor,
        first: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Next-token logits after positions ``first[b] .. end[b] - 1`` of ``tokens [B, W]``
        (row ``b``'s context is ``tokens[b, :end[b]]``, ``first[b] < end[b]``).

        Returns ``[B, K, V]`` float, ``K = max(end - first)`` over the rows asked for (``rows
        [B]`` bool, default all); ``[b, j]`` is the distribution after position
        ``first[b] + j``. Entries past a row's own count, and rows not asked for, are
        unspecified (and such rows' state does not change).
        """
        raise NotImplementedError


def _counts(end: torch.Tensor, first: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``end - first`` for the rows asked for, 0 for the others: ``[B]``."""
    k = end - first
    return k if rows is None else torch.where(rows, k, torch.zeros_like(k))


class CausalLMModel(ProbModel):
    """Any causal LM sharing the target's tokenizer (a small LM, or :func:`early_exit_model`).

    Keeps one :class:`~redraft.infer.runner.kv.SlotKVCache` for the batch, rows of different lengths.
    A :meth:`logits` call feeds each row only what its cache lacks (``tokens[b, length_b :
    end_b]``, after cutting the row back to ``first[b]`` so the asked positions are fed), in one
    forward of the batch with a per-row causal mask, and keeps what it fed.

    Args:
        model: the causal LM.
        name: stats label.
        vocab_size: pad (or cut) its logits to this many ids (the target's vocab).
        vocab_subset: ``[S]`` token ids: compute the head over these rows only (the head of a
            small model is most of its cost: 49152 x 576 for SmolLM2, 8 decoder layers' worth of
            weights), every other token gets probability 0. Costs a copy of ``S`` head rows.
    """

    def __init__(
        self,
        model: nn.Module,
        name: str = "lm",
        vocab_size: int | None = None,
        vocab_subset: torch.Tensor | None = None,
    ):
        self.model = model.eval()
        self.name = name
        self.vocab_size = vocab_size
        self.base = getattr(model, model.base_model_prefix)
        self.head = model.get_output_embeddings()
        w = self.head.weight
        self.device, self.dtype = w.device, next(self.base.parameters()).dtype
        self.cache: SlotKVCache | None = None
        self.calls = 0
        self.subset = None
        if vocab_subset is not None:
            self.subset = torch.as_tensor(vocab_subset, dtype=torch.long, device=w.device)
            self.sub_w = w.detach()[self.subset].contiguous()  # [S, H]
            self.sub_b = None if self.head.bias is None else self.head.bias.detach()[self.subset]
            self.full_v = vocab_size or w.shape[0]

    @property
    def forwards(self) -> int:
        """Forwards run so far (one per :meth:`logits` call that fed anything)."""
        return self.calls

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` tokens each row's cache holds."""
        return self.cache.lengths

    def reset(self, batch_size: int = 0) -> None:
        self.cache = SlotKVCache(self.model.config, max(batch_size, 1), 64, self.dtype, self.device)
        self.cache.add_rows(batch_size)

    def add_rows(self, n: int) -> None:
        if self.cache is None:
            self.reset(n)
        elif n:
            self.cache.add_rows(n)

    def select_rows(self, keep: torch.Tensor) -> None:
        idx = keep.tolist()
        self.cache.lengths = self.cache.lengths[keep.to(self.device)]
        self.cache.keep_rows(idx)

    def truncate(self, lengths: torch.Tensor) -> None:
        # columns past a row's length are free: nothing to move
        self.cache.lengths = torch.minimum(self.cache.lengths, lengths.to(self.device))

    @torch.no_grad()
    def logits(self, tokens, end, first, rows=None) -> torch.Tensor:
        dev, c = self.device, self.cache
        tokens, end, first = tokens.to(dev), end.to(dev), first.to(dev)
        rows = None if rows is None else rows.to(dev)
        B = tokens.shape[0]
        start = torch.minimum(
            c.lengths, first
        )  # the asked positions must be fed to get their logits
        if rows is not None:
            start = torch.where(rows, start, c.lengths)
        c.lengths = start
        n = _counts(end, start, rows)  # [B] tokens fed per row
        low = start if rows is None else torch.where(rows, start, torch.iinfo(torch.long).max)
        # one host read: the forward's width, the logits asked for, the longest and the shortest
        # fed row now
        N, K, top, low = torch.stack(
            [n.max(), _counts(end, first, rows).max(), start.max(), low.min()]
        ).tolist()
        V = self.vocab_size or (
            self.full_v if self.subset is not None else self.head.weight.shape[0]
        )
        if N == 0:
            return torch.zeros((B, K, V), device=dev)
        ar = cached_arange(N, dev)
        ids = tokens.gather(1, (start[:, None] + ar).clamp(max=tokens.shape[1] - 1)).clamp_min(
            0
        )  # [B, N]
        c.reserve(B, top + N)
        c.begin(start, N, span=top + N)  # row b's fed tokens go to columns start[b] ..
        mask = None
        if low < top:  # fed rows start at different columns: a per-row mask places them
            # a fed token sees its row's cache, the row's fed tokens before it, and itself (padding
            # tokens past a row's count only themselves and what precedes them: no empty softmax)
            causal = torch.tril(torch.ones((N, N), dtype=torch.bool, device=dev))
            anc = causal[None] & (
                (ar[None] < n[:, None])[:, None, :] | torch.eye(N, dtype=torch.bool, device=dev)
            )
            mask = c.attention_bias(anc, self.dtype)
        # else every fed row starts at column `top`: the model's own causal mask is right (and the
        # unmasked attention kernel faster; rows not fed compute garbage nobody reads)
        h = self.base(
            input_ids=ids,
            attention_mask=mask,
            position_ids=start[:, None] + ar,
            **cache_kwargs(self.base, c),
            use_cache=True,
        ).last_hidden_state
        c.lengths = start + n  # each row keeps its own n[b] tokens, already in place
        self.calls += 1
        idx = ((first - start)[:, None] + cached_arange(K, dev)).clamp(0, N - 1)  # [B, K]
        return self._head(h.gather(1, idx[:, :, None].expand(-1, -1, h.shape[-1])))

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """``[B, K, H]`` final hidden states -> ``[B, K, V]`` float logits over the target vocab."""
        if self.subset is not None:
            sub = h @ self.sub_w.T  # [B, K, S]
            if self.sub_b is not None:
                sub = sub + self.sub_b
            logits = sub.new_full((*sub.shape[:-1], self.full_v), float("-inf")).index_copy_(
                -1, self.subset, sub
            )
        else:
            logits = self.head(h)
        logits = logits.float()
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            pad = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
            m = min(self.vocab_size, logits.shape[-1])
            pad[..., :m] = logits[..., :m]
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
    (the rest of the vocabulary has probability 0; an unknown context gives the uniform
    distribution, of maximal entropy, so self-verify stops there). Stateless: one vectorised
    table look-up per call for every row and position."""

    def __init__(self, table, vocab_size: int, top_k: int = 12, name: str = "trigram"):
        self.table = as_trigram_table(table)
        self.V, self.k, self.name = vocab_size, top_k, name
        self.calls = 0

    def logits(self, tokens, end, first, rows=None) -> torch.Tensor:
        B, W = tokens.shape
        K = int(_counts(end, first, rows).max())
        pos = first[:, None] + cached_arange(K, tokens.device)  # [B, K] position of w2
        w2 = tokens.gather(1, pos.clamp(0, W - 1))
        w1 = torch.where(pos >= 1, tokens.gather(1, (pos - 1).clamp(0, W - 1)), -1)
        # the table's torch lookup, on the tokens' device: no host round trip per call
        ids, probs = self.table.successors(w1.reshape(-1), w2.reshape(-1), self.k)  # [BK, k]
        mass = probs.sum(1, keepdim=True)  # [BK, 1]
        logp = torch.where(ids >= 0, probs / mass.clamp_min(1e-12), 0.0).log()
        # ids -1 (fewer successors) go to a spare column V, dropped after the scatter
        out = torch.full((B * K, self.V + 1), float("-inf"), device=tokens.device)
        out.scatter_(1, torch.where(ids >= 0, ids.long(), self.V), logp)
        out = out[:, : self.V]
        out[mass[:, 0] <= 0] = 0.0  # unknown context: uniform (max entropy)
        self.calls += 1
        return out.reshape(B, K, self.V)
