"""Model-derived draft tables (N-Grammys, Stewart et al. 2024), from the target's weights alone.

* unigram: ``p(x) ∝ exp(-d(x))``, ``d(x) = ||u_x - ū||_V`` with ``<a, b>_V = aᵀ VᵀV b``
  (V the input embeddings ``[vocab, H]``, U the output embeddings, ū their mean). Since
  ``||a||_V = ||V a||_2``, ``d(x)² = (u_x - ū)ᵀ G (u_x - ū)`` with the ``[H, H]`` Gram matrix
  ``G = VᵀV``: one ``[vocab, H] @ [H, H]`` product instead of a ``[vocab, vocab]`` one.
* bigram: ``p_M(· | x)`` for every token x, the target's next-token distribution on the
  one-token sequence ``[x]`` at position 0, or on ``[BOS, x]`` when the tokenizer prepends a BOS
  token to every encoding (Llama-2 style). :func:`bigram_context` is the one place that decides,
  and the artifact records it (``ngrams.json: bigram.bos_prefix``).
* extended bigram: each of x's top-k successors chained to w tokens, greedily through the
  bigram table (:func:`build_extended`) or through the target itself
  (:func:`build_extended_with_model`, costly: for GPUs).

Fast bigram path. With a single token and no cache, attention attends to exactly one key: the
softmax is 1, RoPE at position 0 is the identity, and a decoder layer reduces to
``h += o_proj(repeat_kv(v_proj(norm1(h)))); h += mlp(norm2(h))``. q and k projections, rotary
embeddings, masks and SDPA are skipped. The fast path runs only for Llama-like architectures and
is checked against the model's own forward on a few tokens before it is used; otherwise (or with
a BOS prefix) the builder runs the model's ordinary forward.
"""

from __future__ import annotations

import copy
import logging

import torch
from tqdm.auto import tqdm

from redraft.utils import cache_kwargs, resolve_dtype

logger = logging.getLogger(__name__)

# Architectures whose decoder layer is exactly norm → attention → residual → norm → MLP →
# residual with the attributes used by the fast path (checked numerically anyway).
FAST_PATH_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def cast_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` whose floating parameters and buffers are in ``dtype``.

    Like ``copy.deepcopy(model).to(dtype)`` without the intermediate full-precision copy: the
    converted tensors are put in deepcopy's memo, so tied weights stay tied.
    """
    memo = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point() and id(t) not in memo:
            new = t.detach().to(dtype)
            memo[id(t)] = (
                torch.nn.Parameter(new, requires_grad=False)
                if isinstance(t, torch.nn.Parameter)
                else new
            )
    return copy.deepcopy(model, memo)


# --------------------------------------------------------------------------------------------
# unigram


@torch.no_grad()
def unigram_probs(target) -> torch.Tensor:
    """The full model unigram ``p(x) ∝ exp(-||u_x - ū||_V)``, float64 ``[vocab]`` (sums to 1)."""
    V = target.input_embedding.weight.detach().to("cpu", torch.float64)  # [vocab_in, H]
    U = target.output_head.weight.detach().to("cpu", torch.float64)  # [vocab, H]
    G = V.T @ V  # [H, H]: <a, b>_V = aᵀ G b
    D = U - U.mean(dim=0, keepdim=True)  # [vocab, H]
    d2 = ((D @ G) * D).sum(dim=-1).clamp_min(0.0)  # [vocab]; clamp: rounding can give -1e-12
    return torch.softmax(-d2.sqrt(), dim=-1)


def build_unigram(target, k: int = 25) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the model unigram.

    Returns:
        ``(ids int32 [k], probs float32 [k])``, most probable first; probabilities are normalised
        over the whole vocabulary (they sum to less than 1).
    """
    p = unigram_probs(target)
    k = min(int(k), p.numel())
    probs, ids = torch.topk(p, k)
    return ids.to(torch.int32), probs.to(torch.float32)


# --------------------------------------------------------------------------------------------
# bigram


# GPT-2-style byte-level BPE vocabularies (SmolLM, Qwen, StarCoder, GPT-2) separate pretraining
# documents with this token: the natural "start of text" context for a model without a BOS.
DOCUMENT_SEPARATOR = "<|endoftext|>"


def bigram_context(tokenizer) -> int | None:
    """The token a bigram row is conditioned on: row x is ``p_M(· | [c, x])`` with c this id.

    Position 0 is an attention sink in most LMs: the next-token distribution of a lone token is
    degenerate (SmolLM2 on ShareGPT: the top-1 of ``p(· | [x])`` is the actual next token 0.55%
    of the time, of ``p(· | [<|endoftext|>, x])`` 9.8%, top-10 20% vs 30%). So rows are built after
    one start-of-text token, chosen as: the BOS the tokenizer prepends to every encoding
    (Llama-2, Mistral); else ``<|endoftext|>`` when the vocabulary has it (the document separator
    of GPT-2-style vocabularies, SmolLM2's included); else the tokenizer's ``bos_token``; else its
    ``eos_token``; else None (rows of the lone token). ``ngrams.json: bigram.bos_prefix`` records it.
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        try:
            ids = tokenizer("a", add_special_tokens=True)["input_ids"]
        except Exception:  # a tokenizer that cannot encode plain text
            ids = []
        if len(ids) > 0 and int(ids[0]) == int(bos):
            return int(bos)
    sep = tokenizer.get_vocab().get(DOCUMENT_SEPARATOR) if hasattr(tokenizer, "get_vocab") else None
    for candidate in (sep, bos, getattr(tokenizer, "eos_token_id", None)):
        if candidate is not None:
            return int(candidate)
    return None


def _fast_path_ok(model) -> bool:
    cfg = model.config
    if getattr(cfg, "model_type", None) not in FAST_PATH_MODEL_TYPES:
        return False
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        return False
    layer = inner.layers[0]
    needed = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
    return all(hasattr(layer, a) for a in needed) and all(
        hasattr(layer.self_attn, a) for a in ("v_proj", "o_proj")
    )


def _heads(cfg) -> tuple[int, int, int]:
    """``(n_heads, n_kv, rep)``: query heads, key/value heads, query heads per kv head."""
    n_heads = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    return n_heads, n_kv, n_heads // n_kv


def _repeat_kv_flat(v: torch.Tensor, n_kv: int, rep: int) -> torch.Tensor:
    """``[B, n_kv * d]`` → ``[B, n_kv * rep * d]``: kv head j serves query heads j*rep..(j+1)*rep-1
    (HF ``repeat_kv``)."""
    B = v.shape[0]
    return v.view(B, n_kv, 1, -1).expand(B, n_kv, rep, v.shape[-1] // n_kv).reshape(B, -1)


def _single_token_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """Last hidden state (after the final norm) of each one-token sequence ``ids`` [B] → [B, H].

    Attention over one key at position 0 is the identity on the value vector (see module doc).
    """
    n_heads, n_kv, rep = _heads(model.config)
    inner = model.model
    h = inner.embed_tokens(ids)  # [B, H]
    for layer in inner.layers:
        attn = layer.self_attn
        v = attn.v_proj(layer.input_layernorm(h))  # [B, n_kv * head_dim]
        if rep > 1:  # GQA
            v = _repeat_kv_flat(v, n_kv, rep)
        h = h + attn.o_proj(v)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return inner.norm(h)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _prefix_state(model, prefix: int, device) -> tuple[list, torch.Tensor, torch.Tensor]:
    """What every row shares when rows are ``[prefix, x]``.

    Returns:
        ``kv``: per layer ``(k0, v0)``, each ``[n_kv, head_dim]``: the prefix's key (RoPE at
        position 0 is the identity) and value; ``cos, sin``: ``[head_dim]`` RoPE at position 1.
    """
    n_heads, n_kv, rep = _heads(model.config)
    inner = model.model
    h = inner.embed_tokens(torch.tensor([prefix], device=device))  # [1, H]
    kv = []
    for layer in inner.layers:
        attn = layer.self_attn
        hn = layer.input_layernorm(h)
        k0 = attn.k_proj(hn).view(n_kv, -1)  # [n_kv, d]
        if hasattr(attn, "k_norm"):  # qwen3: per-head norm before RoPE
            k0 = attn.k_norm(k0)
        v = attn.v_proj(hn)  # [1, n_kv * d]
        kv.append((k0, v.view(n_kv, -1)))
        # the prefix attends to itself only: its attention output is its value
        h = h + attn.o_proj(_repeat_kv_flat(v, n_kv, rep))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    cos, sin = inner.rotary_emb(h[:, None], torch.tensor([[1]], device=device))  # [1, 1, d]
    return kv, cos.view(-1), sin.view(-1)


def _prefixed_hidden(model, ids: torch.Tensor, state) -> torch.Tensor:
    """Last hidden state (after the final norm) of each sequence ``[prefix, ids[i]]`` → [B, H].

    The prefix's keys and values are computed once (:func:`_prefix_state`); each row's token at
    position 1 attends to two keys, so attention is two dot products and a 2-way softmax per
    head: no masks, no SDPA, no cache objects.
    """
    kv, cos, sin = state
    n_heads, n_kv, rep = _heads(model.config)
    inner = model.model
    h = inner.embed_tokens(ids)  # [B, H]
    B = h.shape[0]
    for layer, (k0, v0) in zip(inner.layers, kv):
        attn = layer.self_attn
        hn = layer.input_layernorm(h)
        q = attn.q_proj(hn).view(B, n_heads, -1)  # [B, heads, d]
        k = attn.k_proj(hn).view(B, n_kv, -1)  # [B, n_kv, d]
        v = attn.v_proj(hn).view(B, n_kv, -1)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        d = q.shape[-1]
        scale = float(getattr(attn, "scaling", d**-0.5))
        qg = q.view(B, n_kv, rep, d).float()  # query heads grouped by their kv head (GQA)
        s0 = (qg * k0.float()[None, :, None, :]).sum(-1)  # [B, n_kv, rep] score vs the prefix
        s1 = (qg * k.float()[:, :, None, :]).sum(-1)  # [B, n_kv, rep] score vs itself
        a = torch.softmax(torch.stack([s0, s1], -1) * scale, dim=-1).to(
            v.dtype
        )  # [B, n_kv, rep, 2]
        out = a[..., :1] * v0[None, :, None, :] + a[..., 1:] * v[:, :, None, :]  # [B, n_kv, rep, d]
        h = h + attn.o_proj(out.reshape(B, n_heads * d))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return inner.norm(h)


def _model_last_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The model's ordinary forward, logits of the last position only: [B, T] → [B, vocab]."""
    try:
        out = model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    except TypeError:  # models without logits_to_keep
        out = model(input_ids=input_ids, use_cache=False)
    return out.logits[:, -1]


@torch.no_grad()
def _shortcut_hidden(model, bos_id: int | None, device):
    """The single-token shortcut for ``model``: token ids ``[B]`` -> final hidden states
    ``[B, H]`` (module doc), after the BOS prefix when ``bos_id`` is set."""
    if bos_id is None:
        return lambda x: _single_token_hidden(model, x)
    state = _prefix_state(model, bos_id, device)
    return lambda x: _prefixed_hidden(model, x, state)


def _shortcut_agrees(target, tokens: torch.Tensor, bos_id: int | None) -> bool:
    """Whether the shortcut matches the model's own forward on a few of ``tokens``.

    Checked on the target as given (float32 on CPU): a structural mismatch shows as a large
    error there, while two bf16 computations differ by rounding alone.
    """
    device = target.device
    probe = tokens[: min(8, len(tokens))].to(device)
    seq = (
        probe[:, None]
        if bos_id is None
        else torch.stack([torch.full_like(probe, bos_id), probe], 1)
    )
    ref = _model_last_logits(target.model, seq).float()
    got = target.model.get_output_embeddings()(
        _shortcut_hidden(target.model, bos_id, device)(probe)
    ).float()
    tol = 1e-3 if target.dtype == torch.float32 else 0.25
    err = (ref - got).abs().max().item() / max(ref.abs().max().item(), 1e-6)
    if not err <= tol:
        logger.warning(
            "the single-token shortcut differs from the model forward (relative "
            "error %.3g); using the model forward",
            err,
        )
        return False
    return True


def build_bigram(
    target,
    k: int = 25,
    batch_size: int = 1024,
    dtype="bfloat16",
    bos: int | None | str = "auto",
    fast_path: bool = True,
    progress: bool = True,
    tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``p_M(· | x)`` for every token x (or for ``tokens``), batched.

    Args:
        target: a :class:`redraft.models.Target`.
        k: successors kept per token.
        batch_size: tokens per forward.
        dtype: compute dtype (``"bfloat16"`` uses AMX on recent Xeons and tensor cores on GPUs;
            ``"float32"`` reproduces the float32 model). Top-k is taken on the logits as
            computed, the softmax normaliser in float32.
        bos: ``"auto"`` (:func:`bigram_context`), a BOS id to prefix, or None for none.
        fast_path: use the single-token shortcut (module doc) when the architecture allows.
        tokens: build rows only for these ids (LongTensor [N]); default every id in the vocab.

    Returns:
        ``(ids int32 [N, k], probs float32 [N, k])`` on CPU; row i belongs to token ``tokens[i]``
        (row x to token x by default), successors most probable first.
    """
    dtype = resolve_dtype(dtype)
    model = target.model
    device = target.device
    if target.dtype != dtype:  # a private copy: the caller's target is left as it was
        model = cast_copy(model, dtype)
    bos_id = bigram_context(target.tokenizer) if bos == "auto" else bos
    V = target.vocab_size
    k = min(int(k), V)
    if tokens is None:
        tokens = torch.arange(V)
    tokens = tokens.to(torch.long).cpu()

    use_fast = fast_path and _fast_path_ok(model)
    if use_fast and bos_id is not None:
        use_fast = hasattr(model.model, "rotary_emb")
    if use_fast:
        use_fast = _shortcut_agrees(target, tokens, bos_id)
    hidden = _shortcut_hidden(model, bos_id, device) if use_fast else None

    ids_out = torch.empty(len(tokens), k, dtype=torch.int32)
    probs_out = torch.empty(len(tokens), k, dtype=torch.float32)
    head = model.get_output_embeddings()
    bar = tqdm(
        total=len(tokens), desc=f"bigram top-{k}", unit="tok", unit_scale=True, disable=not progress
    )
    for start in range(0, len(tokens), batch_size):
        x = tokens[start : start + batch_size].to(device)  # [B]
        if use_fast:
            logits = head(hidden(x))  # [B, vocab]
        else:
            seq = x[:, None] if bos_id is None else torch.stack([torch.full_like(x, bos_id), x], 1)
            logits = _model_last_logits(model, seq)
        # Top-k on the logits as computed (a bf16 value is exact in float32, so the ranking is
        # the same); the normaliser in float32, 64 rows at a time so the float32 copy
        # ([64, vocab]) stays in cache instead of streaming a [B, vocab] one through memory.
        top, idx = torch.topk(logits, k, dim=-1)  # [B, k]
        lse = torch.cat(
            [
                torch.logsumexp(logits[r : r + 64].float(), dim=-1, keepdim=True)
                for r in range(0, len(logits), 64)
            ]
        )  # [B, 1]
        probs = torch.exp(top.float() - lse)
        ids_out[start : start + len(x)] = idx.to("cpu", torch.int32)
        probs_out[start : start + len(x)] = probs.cpu()
        bar.update(len(x))
    bar.close()
    return ids_out, probs_out


# --------------------------------------------------------------------------------------------
# extended bigram


def build_extended(bigram_ids: torch.Tensor, w: int = 10, k: int | None = None) -> torch.Tensor:
    """Chain each top-k successor greedily through the bigram table to ``w`` tokens.

    ``ext[x, j, 0] = bigram[x, j]`` and ``ext[x, j, i] = bigram[ext[x, j, i-1], 0]``.
    Example: with top-1 successors a→b, b→c, c→a and ``bigram[x] = [a, c]``, ``w=3`` gives
    ``ext[x] = [[a, b, c], [c, a, b]]``.

    Args:
        bigram_ids: ``[vocab, k0]`` top successors (int), row x belonging to token x.
        w: chain length (tokens per row, the successor itself included).
        k: successors extended per token (default all k0).

    Returns:
        ``int32 [vocab, k, w]``.
    """
    k = bigram_ids.shape[1] if k is None else min(int(k), bigram_ids.shape[1])
    top1 = bigram_ids[:, 0].to(torch.long)  # [vocab]
    cur = bigram_ids[:, :k].to(torch.long)  # [vocab, k]
    cols = [cur]
    for _ in range(1, int(w)):  # w steps of a vocab-wide gather, no per-token Python
        cur = top1[cur]
        cols.append(cur)
    return torch.stack(cols, dim=-1).to(torch.int32)  # [vocab, k, w]


@torch.no_grad()
def build_extended_with_model(
    target,
    bigram_ids: torch.Tensor,
    w: int = 10,
    k: int | None = None,
    batch_size: int = 512,
    dtype="bfloat16",
    bos: int | None | str = "auto",
    progress: bool = True,
) -> torch.Tensor:
    """Like :func:`build_extended`, but each chain is decoded greedily by the target itself.

    Row ``[x, j]`` is ``y = bigram[x, j]`` followed by the target's greedy continuation of
    ``[BOS?, x, y]`` for ``w - 1`` tokens. Costs ``vocab * k`` short generations: meant for GPUs.

    Returns:
        ``int32 [vocab, k, w]``.
    """
    from transformers import DynamicCache

    dtype = resolve_dtype(dtype)
    model = target.model if target.dtype == dtype else cast_copy(target.model, dtype)
    device = target.device
    bos_id = bigram_context(target.tokenizer) if bos == "auto" else bos
    Vn, k0 = bigram_ids.shape
    k = k0 if k is None else min(int(k), k0)
    firsts = torch.arange(Vn)[:, None].expand(Vn, k).reshape(-1)  # [vocab*k]
    seconds = bigram_ids[:, :k].reshape(-1).to(torch.long)  # [vocab*k]
    out = torch.empty(Vn * k, int(w), dtype=torch.int32)
    out[:, 0] = seconds.to(torch.int32)
    bar = tqdm(
        total=Vn * k,
        desc=f"extended w={w} (model)",
        unit="seq",
        unit_scale=True,
        disable=not progress,
    )
    for s in range(0, Vn * k, batch_size):
        x, y = firsts[s : s + batch_size].to(device), seconds[s : s + batch_size].to(device)
        seq = (
            torch.stack([x, y], 1)
            if bos_id is None
            else torch.stack([torch.full_like(x, bos_id), x, y], 1)
        )
        cache = DynamicCache()
        step = seq
        for i in range(1, int(w)):
            logits = model(input_ids=step, **cache_kwargs(model, cache), use_cache=True).logits[
                :, -1
            ]
            step = logits.float().argmax(-1, keepdim=True)  # [B, 1]
            out[s : s + len(x), i] = step[:, 0].to("cpu", torch.int32)
        bar.update(len(x))
    bar.close()
    return out.view(Vn, k, int(w))


__all__ = [
    "FAST_PATH_MODEL_TYPES",
    "bigram_context",
    "build_bigram",
    "build_extended",
    "build_extended_with_model",
    "build_unigram",
    "unigram_probs",
]
