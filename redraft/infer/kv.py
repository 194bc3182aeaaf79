"""A preallocated KV cache whose rows can hold different numbers of tokens.

All layers' keys and values live in one buffer ``kv [layers, 2, B, kv_heads, capacity, head_dim]``
so that committing the accepted tree tokens is one gather and one scatter for the whole model.

Row ``b`` holds ``lengths[b]`` valid tokens at columns ``0 .. lengths[b]-1``; the physical length
``T`` is the longest row; columns ``lengths[b] .. T-1`` of a shorter row are holes that the
decoder's attention mask hides. A verify forward writes the ``n`` tree tokens at columns
``T .. T+n-1`` of every row (transformers' ``Cache.update`` contract: append and return
everything); :meth:`TreeKVCache.commit` then moves each row's accepted tree tokens to
``lengths[b] ..`` and drops the rest. Rotary embeddings are applied before keys are cached, so
moving a key does not change its position.

Static mode (``static=True``, for a verify forward captured in a CUDA graph): a forward writes
its tokens at the columns held in the device tensor ``write_pos`` and attends to all
``capacity`` columns (the mask hides what a row must not see), so no shape and no index in the
forward depends on a host integer that changes from step to step.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _BufferLayer(CacheLayerMixin):
    """One layer's view into the shared buffer (transformers' cache-layer protocol)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: "TreeKVCache", idx: int):
        super().__init__()
        self.cache, self.idx = cache, idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):  # pragma: no cover - preallocated
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        c = self.cache
        if c.static:  # write at write_pos, attend over the whole buffer: static shapes and indices
            c.kv[self.idx, 0].index_copy_(2, c.write_pos, key_states)
            c.kv[self.idx, 1].index_copy_(2, c.write_pos, value_states)
            if self.idx == c.num_layers - 1:
                c.pending = key_states.shape[-2]
            return c.kv[self.idx, 0], c.kv[self.idx, 1]
        T, n = c.physical, key_states.shape[-2]
        c.ensure_capacity(T + n)
        c.kv[self.idx, 0, :, :, T:T + n] = key_states
        c.kv[self.idx, 1, :, :, T:T + n] = value_states
        if self.idx == c.num_layers - 1:
            c.pending = n  # the forward's tokens are in; commit() decides what stays
        return c.kv[self.idx, 0, :, :, :T + n], c.kv[self.idx, 1, :, :, :T + n]

    @property
    def keys(self):
        return self.cache.kv[self.idx, 0, :, :, :self.cache.physical]

    @keys.setter
    def keys(self, value):
        pass

    @property
    def values(self):
        return self.cache.kv[self.idx, 1, :, :, :self.cache.physical]

    @values.setter
    def values(self, value):
        pass

    def get_mask_sizes(self, query_length: int):
        return self.cache.physical + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.physical

    def get_max_length(self) -> int:
        return -1


class TreeKVCache(Cache):
    """KV cache for tree verification with per-row lengths.

    Args:
        model_config: the target's config (layers, kv heads, head dim).
        batch_size, capacity: initial buffer size (grows by doubling when needed).
        dtype, device: of the buffer (the model's).
    """

    def __init__(self, model_config, batch_size: int, capacity: int, dtype, device):
        cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.num_layers = int(cfg.num_hidden_layers)
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.kv = torch.zeros((self.num_layers, 2, batch_size, heads, capacity, head_dim), dtype=dtype, device=device)
        self.physical = 0  # T: columns in use (longest row)
        self.pending = 0  # columns appended by the last forward, not yet committed
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.static = False  # see the module doc
        self.write_pos: torch.Tensor | None = None
        self.graphs: dict = {}  # captured verify forwards over this buffer (redraft.infer.verify)
        super().__init__(layers=[_BufferLayer(self, i) for i in range(self.num_layers)])

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[4])

    def _replace_buffer(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.graphs.clear()  # they captured the old buffer's address

    def ensure_capacity(self, needed: int) -> None:
        cap = self.kv.shape[4]
        if needed <= cap:
            return
        new = torch.zeros((*self.kv.shape[:4], max(needed, 2 * cap), self.kv.shape[5]),
                          dtype=self.kv.dtype, device=self.kv.device)
        new[:, :, :, :, :cap] = self.kv
        self._replace_buffer(new)

    def commit(self, keep: torch.Tensor, num_keep: torch.Tensor, physical: int | None = None) -> None:
        """Keep, per row, tokens of the last forward and drop the others.

        Args:
            keep: ``[B, A]`` long: indices (0-based within the last forward's tokens) to keep,
                in order; entries past ``num_keep[b]`` are ignored.
            num_keep: ``[B]`` long: how many of ``keep[b]`` are real.
            physical: the longest row after the commit, when the caller knows it without reading
                the device (the decoder keeps the row lengths on the host); ``None`` reads it.
        """
        T = self.physical
        B, A = keep.shape
        src = (T + keep.clamp_min(0))  # [B, A]
        dst = self.lengths[:, None] + torch.arange(A, device=keep.device)[None]  # [B, A]
        # padding entries copy the first kept token onto columns past the row's new length
        # (holes, masked); the buffer is big enough since dst < T + A <= T + pending.
        # One index_select + index_copy_ per row over all layers at once: gather/scatter with
        # broadcast indices copy the whole buffer on CPU (docs/infer.md, "KV commit").
        for b in range(B):
            row = self.kv[:, :, b]  # [layers, 2, heads, capacity, head_dim] view
            row.index_copy_(3, dst[b], row.index_select(3, src[b]))
        self.lengths = self.lengths + num_keep
        self.physical = physical if physical is not None else (int(self.lengths.max()) if B else 0)
        self.pending = 0

    def set_prefill(self, lengths: torch.Tensor, physical: int | None = None) -> None:
        """After a prefill forward over right-padded prompts: row b holds ``lengths[b]`` tokens."""
        self.lengths = lengths.clone()
        self.physical = physical if physical is not None else int(lengths.max())
        self.pending = 0

    def select_rows(self, rows: torch.Tensor, physical: int | None = None) -> None:
        """Keep batch rows ``rows`` ([B'] long) and drop the others."""
        self._replace_buffer(self.kv.index_select(2, rows))
        self.lengths = self.lengths.index_select(0, rows)
        if physical is None:
            physical = int(self.lengths.max()) if rows.numel() else 0
        self.physical = physical

    def append_rows(self, other: "TreeKVCache") -> None:
        """Add the rows of ``other`` (same model, e.g. new requests just prefilled) after this
        cache's rows. Column counts may differ: the shorter buffer is padded with holes."""
        self.ensure_capacity(other.kv.shape[4])
        cap = self.kv.shape[4]  # ensure_capacity may grow past what was asked (doubling)
        kv = other.kv
        if kv.shape[4] < cap:
            kv = torch.cat([kv, kv.new_zeros((*kv.shape[:4], cap - kv.shape[4], kv.shape[5]))], dim=4)
        self._replace_buffer(torch.cat([self.kv, kv], dim=2))
        self.lengths = torch.cat([self.lengths, other.lengths])
        self.physical = max(self.physical, other.physical)

    @property
    def batch_size(self) -> int:
        return int(self.kv.shape[2])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.physical

    def attention_bias(self, tree_anc: torch.Tensor, dtype) -> torch.Tensor:
        """Additive 4D mask for a forward of ``n`` tree tokens: ``[B, 1, n, T+n]``, or
        ``[B, 1, n, capacity]`` in static mode (the tree's columns at ``T .. T+n-1``).

        Cache columns: row b sees ``0 .. lengths[b]-1``; tree columns: ``tree_anc [B, n, n]``.
        """
        B, n, _ = tree_anc.shape
        T = self.physical
        cols = self.capacity if self.static else T
        c = torch.arange(cols, device=tree_anc.device)
        cache_vis = (c[None, :] < self.lengths[:, None])[:, None, :].expand(B, n, cols)
        if self.static:
            vis = cache_vis.clone()
            vis[:, :, T:T + n] = tree_anc
        else:
            vis = torch.cat([cache_vis, tree_anc], dim=2)  # [B, n, T+n]
        bias = torch.zeros(vis.shape, dtype=dtype, device=vis.device)
        bias.masked_fill_(~vis, torch.finfo(dtype).min)
        return bias[:, None]
