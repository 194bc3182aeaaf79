"""Attention for a batch whose rows hold very different numbers of tokens (CPU decoding).

The verify forward attends every row over the batch's longest row (``span`` columns; a row's
own mask hides the rest). When one 4,000-token prompt joins eight 100-token chats, every row
reads 4,000 columns of keys and values per layer; sixteen chats of a few dozen to several
hundred tokens read several times the columns they hold. Here the batch is cut into runs of
consecutive rows (:func:`row_groups`), each attended over its own longest row, one SDPA call per
run, views of the cache (nothing is gathered); masked columns carry no weight, so the output is
what one call over the whole span gives.

Only CPU forwards split rows in runs (a captured CUDA graph attends over one fixed span by
design), but every :class:`~redraft.infer.runner.verify.Verifier` switches its target from ``sdpa`` to
this function (registered with transformers' ``AttentionInterface``), which is plain ``sdpa``
unless the verifier set the groups of the current forward (:func:`grouped`). Every call,
grouped or not, goes through :func:`packed_sdpa`: the query heads that share a key/value head
attend as that head's rows instead of copying its keys and values per query head (1.2-1.4x a
verify forward of the default target over 4,000 cached tokens in float32 on a CPU;
docs/infer.md). On CUDA that copy is what transformers does for every masked forward of more
than one token (its ``enable_gqa`` path needs no mask): for 40 rows of a 4,096-column cache of
SmolLM2-135M in bfloat16, ~0.38 GB written per layer and read again, which packing removes.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from redraft.infer.runner import tree_attention

NAME = "redraft_grouped_sdpa"
# one more attention call costs about as much as reading this many more key/value columns for
# one query token (SDPA's fixed cost per call against its cost per column, float32 on a CPU)
CALL_COST = 64

_GROUPS: contextvars.ContextVar = contextvars.ContextVar("redraft_row_groups", default=None)
# the current forward's masks with their rows repeated per query head of a key/value head
# (one dict per verifier forward, set by :func:`grouped`: every layer reuses the first's)
_PACKED_MASKS: contextvars.ContextVar = contextvars.ContextVar("redraft_packed", default=None)
# a prefill piece riding in the current verify forward (redraft.infer.runner.kv.Piece), or None
_PIECE: contextvars.ContextVar = contextvars.ContextVar("redraft_piece", default=None)
# the rows of the current flattened prefill forward (redraft.infer.runner.kv.Ragged), or None
_RAGGED: contextvars.ContextVar = contextvars.ContextVar("redraft_ragged", default=None)
# scaled_dot_product_attention's enable_gqa (torch >= 2.5): key/value heads shared without a copy
_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def row_groups(lengths: list[int], n: int) -> list | None:
    """The attention calls of a forward whose row ``b`` holds ``lengths[b]`` cached tokens and
    attends over ``n`` new ones: ``[(rows, span), ...]``, each ``rows`` a slice of consecutive
    rows in batch order (views of the queries, keys, values and mask: nothing is gathered),
    together covering the batch in order; ``None`` when one call is as good. The runs minimise
    ``sum over calls of (rows x span x n + CALL_COST)``, ``span`` the run's longest row plus
    ``n`` (dynamic programming over the cut points).

    Runs, not groups of rows sorted by length: a group of rows that are not neighbours in the
    batch had to be gathered (a copy of their keys and values per layer, more than the
    attention itself reads) and its output scattered back. Rows join a batch shortest prompt
    first and grow together, so their lengths are nearly sorted in batch order; a row leaving
    moves the last row into its slot, which runs absorb with one more call."""
    B = len(lengths)
    if B < 2:
        return None
    spans = [x + n for x in lengths]
    inf = float("inf")
    best, cut = [0.0] + [inf] * B, [0] * (B + 1)  # best[j]: least cost of rows 0..j-1
    for j in range(1, B + 1):
        m = 0
        for i in range(j - 1, -1, -1):  # the last run is rows i..j-1
            m = max(m, spans[i])
            run = (j - i) * m * n + CALL_COST
            if run >= best[j]:  # a longer run costs more still (best[i] >= 0)
                break
            if best[i] + run < best[j]:
                best[j], cut[j] = best[i] + run, i
    runs, j = [], B
    while j > 0:
        i = cut[j]
        runs.append((slice(i, j), max(spans[i:j])))
        j = i
    return runs[::-1] if len(runs) > 1 else None


@contextlib.contextmanager
def grouped(groups: list | None):
    """Forwards inside attend in these runs of rows (:func:`row_groups`; ``None``: one call)."""
    token, memo = _GROUPS.set(groups), _PACKED_MASKS.set({})
    try:
        yield
    finally:
        _GROUPS.reset(token)
        _PACKED_MASKS.reset(memo)


@contextlib.contextmanager
def with_piece(piece):
    """Forwards inside carry ``piece`` (a :class:`~redraft.infer.runner.kv.Piece`) after their verify
    tokens: :func:`grouped_sdpa` attends the two parts apart."""
    token = _PIECE.set(piece)
    try:
        yield
    finally:
        _PIECE.reset(token)


@contextlib.contextmanager
def with_ragged(ragged):
    """Forwards inside are one flattened row of ``ragged``'s rows (a
    :class:`~redraft.infer.runner.kv.Ragged`): :func:`grouped_sdpa` attends each row apart."""
    token = _RAGGED.set(ragged)
    try:
        yield
    finally:
        _RAGGED.reset(token)


def _repeated_mask(mask: torch.Tensor, g: int) -> torch.Tensor:
    """``mask [b, 1, n, S]`` with its rows repeated ``g`` times, ``[b, 1, g n, S]`` (row
    ``j n + t`` is row ``t``), made once per forward."""
    memo = _PACKED_MASKS.get()
    key = (mask.data_ptr(), tuple(mask.shape), mask.stride(), g)
    if memo is not None and key in memo:
        return memo[key]
    out = mask.repeat(1, 1, g, 1)
    if memo is not None:
        memo[key] = out
    return out


def packed_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``sdpa``, with the ``g`` query heads that share a key/value head packed
    into that head's rows for any query length: ``query [B, H, n, d]`` as ``[B, H / g, g n,
    d]`` against the cache's own ``[B, H / g, S, d]`` keys and values, the mask's rows repeated
    ``g`` times (once per forward). transformers packs only a single query token; for a tree
    or a prefill piece it copies the keys and values ``g`` times per layer (``repeat_kv``):
    for SmolLM2-135M (9 heads, 3 key/value heads) over 4,000 cached tokens in float32, 18 MB
    per layer, 550 MB per forward. Each query row meets the same keys, values and mask row as
    before, so the output is the same attention. Pieces of more than ``2 H d / g`` tokens (384
    for SmolLM2-135M, 2,048 for Llama-3-8B) are not packed: their repeated mask would be larger
    than the copies it saves."""
    g = getattr(module, "num_key_value_groups", 1)
    B, H, n, d = query.shape
    if (
        g == 1
        or n == 1  # transformers packs this case itself
        # the repeated mask ([B, 1, g n, S], held for the whole forward) may not outgrow the
        # keys and values that repeat_kv copies per layer ([B, H, S, d] each): a long prefill
        # piece (n in the thousands: an 8B target's 32k-token prompt would need a 8.6 GB mask)
        # takes transformers' path, whose copies are freed layer by layer
        or g * n > 2 * H * d
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(B, H // g, g * n, d),
        key,
        value,
        attn_mask=_repeated_mask(attention_mask, g),
        dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"),
    )  # [B, H / g, g n, d]
    return out.reshape(B, H, n, d).transpose(1, 2).contiguous(), None


def grouped_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``sdpa`` attention, one call per row group of the current forward.
    ``query [B, heads, n, d]``, ``key``/``value [B, kv_heads, span, d]``, ``attention_mask``
    additive ``[B, 1, n, span]``; returns ``([B, n, heads, d], None)`` as ``sdpa`` does.

    With a prefill piece in the forward (:func:`with_piece`) the query is one flattened row
    ``[1, heads, B n + rows T, d]``: its verify part attends as above over ``key``/``value``
    (the verify rows', the cache split them), the piece's part over the piece's own, and the
    outputs are flattened back, ``[1, B n + rows T, heads, d]``."""
    ragged = _RAGGED.get()
    if ragged is not None:
        return ragged_sdpa(module, query, ragged, **kwargs), None
    if tree_attention.supports(module, query, key, kwargs):
        return tree_attention.tree_attention(module, query, key, value, **kwargs), None
    piece = _PIECE.get()
    if piece is not None:
        _, H, _, d = query.shape
        q = query[0]  # [heads, tokens, d]
        B = key.shape[0]
        main = _grouped(
            module,
            q[:, : piece.split].unflatten(1, (B, -1)).transpose(0, 1),
            key,
            value,
            attention_mask,
            **kwargs,
        )  # [B, n, heads, d]
        part = packed_sdpa(
            module,
            q[:, piece.split :].unflatten(1, (piece.rows, piece.T)).transpose(0, 1),
            piece.key,
            piece.value,
            piece.bias,
            **kwargs,
        )[0]  # [rows, T, heads, d]
        return torch.cat([main.reshape(1, -1, H, d), part.reshape(1, -1, H, d)], 1), None
    return _grouped(module, query, key, value, attention_mask, **kwargs), None


def ragged_sdpa(module, query, ragged, **kwargs) -> torch.Tensor:
    """Attention of a flattened prefill forward (:func:`with_ragged`): ``query [1, heads,
    tokens, d]`` holds row b's ``lens[b]`` queries from ``offsets[b]``; each row attends over its
    own cache slot (``ragged.key[b]``, ``ragged.value[b]``: its ``starts[b]`` earlier columns,
    then its new ones causally), one call per row. A row with nothing cached before its tokens
    (a whole prompt) attends causally with no mask at all (``is_causal``): no mask is built or
    read, and the kernel skips the blocks above the diagonal. Returns ``[1, tokens, heads,
    d]``."""
    g = getattr(module, "num_key_value_groups", 1)
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    outs = []
    for b, (s, n, o) in enumerate(zip(ragged.starts, ragged.lens, ragged.offsets)):
        q, k, v = query[:, :, o : o + n], ragged.key[b], ragged.value[b]
        if not plain:  # transformers' path (its own extras), with the row's mask made here
            bias = _row_bias(s, n, q.dtype, q.device)
            out = sdpa_attention_forward(module, q, k, v, bias, **kwargs)[0]
            outs.append(out.transpose(1, 2))
            continue
        if g > 1 and not _GQA:
            k, v = (t.repeat_interleave(g, dim=1) for t in (k, v))
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if s == 0 else _row_bias(s, n, q.dtype, q.device),
                is_causal=s == 0,
                scale=kwargs.get("scaling"),
                **({"enable_gqa": True} if g > 1 and _GQA else {}),
            )
        )  # [1, heads, n, d]
    return torch.cat(outs, 2).transpose(1, 2).contiguous()


def _row_bias(start: int, n: int, dtype, device) -> torch.Tensor:
    """Additive ``[1, 1, n, start + n]`` mask: token i of a row's piece sees its ``start``
    cached columns and its piece's tokens up to i."""
    cols = torch.arange(start + n, device=device)
    vis = cols[None, :] <= start + torch.arange(n, device=device)[:, None]
    bias = torch.zeros(vis.shape, dtype=dtype, device=device)
    return bias.masked_fill_(~vis, torch.finfo(dtype).min)[None, None]


def _grouped(module, query, key, value, attention_mask, **kwargs) -> torch.Tensor:
    """:func:`grouped_sdpa` of one part: ``[B, n, heads, d]``."""
    groups = _GROUPS.get()
    if groups is None or attention_mask is None or attention_mask.dim() != 4:
        return packed_sdpa(module, query, key, value, attention_mask, **kwargs)[0]
    outs = [
        packed_sdpa(
            module,
            query[rows],
            key[rows, :, :span],  # [b, kv_heads, span, d] views
            value[rows, :, :span],
            attention_mask[rows, ..., :span],
            **kwargs,
        )[0]
        for rows, span in groups
    ]
    return torch.cat(outs)  # [B, n, heads, d]: the runs are the batch's rows in order


AttentionInterface.register(NAME, grouped_sdpa)
# the masks transformers builds for this implementation (callers that pass none, e.g. HSDDW's
# draft models over the same weights) are sdpa's: without this line it builds none at all
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_packed_attention(model) -> bool:
    """Switch a model from ``sdpa`` to :func:`grouped_sdpa` on any device; returns whether it
    runs it (also when an earlier verifier over the same model switched it). Every forward then
    packs the query heads of a key/value head (:func:`packed_sdpa`) instead of copying the keys
    and values per query head; the row groups apply only where a verifier sets them (CPU)."""
    impl = model.config._attn_implementation
    if impl not in ("sdpa", NAME):
        return False
    if impl == "sdpa":
        model.set_attn_implementation(NAME)
    return True
