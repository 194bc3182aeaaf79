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


class _SlotLayer(_BufferLayer):
    """One layer of a :class:`SlotKVCache`: per-row writes at each row's own length."""

    def update(self, key_states, value_states, *args, **kwargs):
        c = self.cache
        lo, hi = c.window
        idx = c.write_index.expand_as(key_states)  # [B, heads, n, head_dim]: column of every written entry
        k = c.kv[self.idx, 0, lo:hi]  # [B, heads, capacity, head_dim] view of the active slots
        v = c.kv[self.idx, 1, lo:hi]
        k.scatter_(2, idx, key_states)
        v.scatter_(2, idx, value_states)
        return k[:, :, :c.span], v[:, :, :c.span]

    @property
    def keys(self):
        lo, hi = self.cache.window
        return self.cache.kv[self.idx, 0, lo:hi, :, :self.cache.span]

    @keys.setter
    def keys(self, value):
        pass

    @property
    def values(self):
        lo, hi = self.cache.window
        return self.cache.kv[self.idx, 1, lo:hi, :, :self.cache.span]

    @values.setter
    def values(self, value):
        pass

    def get_mask_sizes(self, query_length: int):
        return self.cache.span, 0

    def get_seq_length(self) -> int:
        return self.cache.span


class SlotKVCache(Cache):
    """The target's KV cache for decoding: fixed slots and capacity, no holes, no per-step moves.

    ``kv [layers, 2, slots, kv_heads, capacity, head_dim]`` is allocated once (it grows by
    doubling only when a request needs more rows or columns than it has, which drops the
    captured graphs over it). The batch's active rows are slots ``0 .. B-1`` (rows leaving are
    compacted in place, rows joining are prefilled straight into the next free slots); row ``b``
    holds ``lengths[b]`` tokens at columns ``0 .. lengths[b]-1``.

    A forward of ``n`` tokens per row writes row b's tokens at columns ``lengths[b] ..
    lengths[b]+n-1`` (one scatter per layer: every index comes from the device tensor
    ``lengths``, so a captured forward is valid for any lengths) and attends over the first
    ``span`` columns: the longest row plus ``n`` (a host int), or the whole capacity when the
    forward runs in a CUDA graph (``static``). :meth:`attention_bias` shows a row its own cache
    columns and its tree's ancestors. Committing a greedy step or an accepted path that is the
    tree's first chain moves nothing: the entries are already where they belong; other accepted
    nodes are moved with one gather and one scatter for the whole batch (:meth:`commit`).

    Host state (no device reads): ``host_lengths`` (list of int per row); device state:
    ``lengths`` ``[B]`` long, set by the caller before every forward.
    """

    def __init__(self, model_config, slots: int, capacity: int, dtype, device):
        cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.num_layers = int(cfg.num_hidden_layers)
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.kv = torch.zeros((self.num_layers, 2, max(slots, 1), heads, capacity, head_dim), dtype=dtype,
                              device=device)
        self.batch = 0  # active rows (slots 0..batch-1)
        self.host_lengths: list[int] = []
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)
        self.window = (0, 0)  # slots the current forward runs over
        self.span = 0  # columns the current forward attends over
        self.write_index: torch.Tensor | None = None  # [B, 1, n, 1] columns the forward writes
        self.generation = 0  # bumped whenever `kv` is reallocated (captured graphs hold its address)
        super().__init__(layers=[_SlotLayer(self, i) for i in range(self.num_layers)])

    @property
    def slots(self) -> int:
        return int(self.kv.shape[2])

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[4])

    @property
    def physical(self) -> int:
        """Columns in use by the longest active row (host int)."""
        return max(self.host_lengths, default=0)

    @property
    def batch_size(self) -> int:
        return self.batch

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.span

    def reserve(self, slots: int, capacity: int) -> bool:
        """Make room for ``slots`` rows of ``capacity`` columns; returns whether the buffer moved."""
        if slots <= self.slots and capacity <= self.capacity:
            return False
        new_slots = max(slots, self.slots * 2 if slots > self.slots else self.slots)
        new_cap = max(capacity, self.capacity * 2 if capacity > self.capacity else self.capacity)
        new = self.kv.new_zeros((*self.kv.shape[:2], new_slots, self.kv.shape[3], new_cap, self.kv.shape[5]))
        new[:, :, :self.slots, :, :self.capacity] = self.kv
        self.kv = new
        self.generation += 1
        return True

    def begin(self, lengths: torch.Tensor, n: int, span: int, rows: tuple[int, int] | None = None) -> None:
        """Set up a forward of ``n`` tokens per row over slots ``rows`` (default: the batch) whose
        rows hold ``lengths [B]`` tokens (device), attending over the first ``span`` columns."""
        self.window = rows or (0, self.batch)
        self.lengths = lengths
        self.write_index = (lengths[:, None] + torch.arange(n, device=lengths.device)[None])[:, None, :, None]
        self.span = span

    def attention_bias(self, anc: torch.Tensor, dtype, columns: torch.Tensor | None = None) -> torch.Tensor:
        """Additive mask ``[B, 1, n, span]`` for the current forward: row b's token i sees cache
        columns ``< lengths[b]`` and the tree columns ``lengths[b] + m`` of its ancestors m
        (``anc [B, n, n]`` bool, ``anc[b, i, m]``). ``columns``: ``arange(span)`` if cached."""
        B, n, _ = anc.shape
        c = torch.arange(self.span, device=anc.device) if columns is None else columns
        rel = c[None, :] - self.lengths[:, None]  # [B, span]: tree node of each column, < 0 = cache
        tree = anc.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(B, n, self.span))  # [B, n, span]
        vis = (rel < 0)[:, None, :] | (tree & (rel < n)[:, None, :])
        return torch.zeros(vis.shape, dtype=dtype, device=vis.device).masked_fill_(
            ~vis, torch.finfo(dtype).min)[:, None]

    def commit_moves(self, rows: list[int], src: list[int], dst: list[int]) -> None:
        """Move entries ``(row, src column) -> (row, dst column)`` for every layer (host lists;
        one upload, one gather, one scatter)."""
        if not rows:
            return
        idx = torch.tensor([rows, src, dst], dtype=torch.long).to(self.kv.device, non_blocking=True)
        self.kv[:, :, idx[0], :, idx[2]] = self.kv[:, :, idx[0], :, idx[1]]

    def keep_rows(self, keep: list[int], pending: list[int] = ()) -> None:
        """Rows ``keep`` (indices of active rows, in order) stay, compacted into slots 0..len-1;
        rows being prefilled (slots after the batch; ``pending``: their indices counted from the
        first slot after it) follow them in order, the others are dropped."""
        slots = list(keep) + [self.batch + j for j in pending]
        if slots != list(range(len(slots))):
            idx = torch.tensor(slots, dtype=torch.long).to(self.kv.device)
            self.kv[:, :, :len(slots)] = self.kv[:, :, idx]
        self.host_lengths = [self.host_lengths[i] for i in keep]
        self.batch = len(keep)
