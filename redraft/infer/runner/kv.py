"""The KV cache of decoding: fixed slots and capacity, rows of their own lengths, no holes.

``kv [layers, 2, slots, kv_heads, capacity, head_dim]`` holds every layer's keys and values in
one buffer. Active rows are slots ``0 .. B-1``; row ``b`` holds ``lengths[b]`` tokens at columns
``0 .. lengths[b]-1``. A forward of ``n`` tokens per row writes row b's at columns
``lengths[b] ..`` (one scatter per layer, every index from the device tensor ``lengths``: the
same captured CUDA graph serves any lengths) and attends over the first ``span`` columns, with
:meth:`SlotKVCache.attention_bias` showing a row its own cache and its tree's ancestors.
Rotary embeddings are applied before keys are cached, so moving a key does not change its
position. The target's verifier (``redraft.infer.runner.verify``) and HSDDW's draft models
(``redraft.infer.drafters.hsddw.models``) both decode over it.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def zeroed(shape, dtype, device) -> torch.Tensor:
    """A zero tensor; on a CPU, backed by an anonymous memory map: the kernel supplies zero pages
    as they are first touched, so making a cache grown for one long prompt in every slot costs
    nothing until columns are written (``torch.zeros`` writes every page at once: 0.94 s for the
    3.3 GB of 17 slots x 4,267 columns of the default target in float32 on a small CPU, more
    under load, on the cores the decoding runs on), and columns no row reaches never take
    memory. CUDA: ``torch.zeros`` (a device memset)."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    # the tensor holds a reference to the map (torch.frombuffer): it lives as long as the tensor
    return torch.frombuffer(mmap.mmap(-1, n), dtype=dtype).view(shape)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``[1, heads, n m, d]`` (a flattened forward's part) -> ``[n, heads, m, d]`` (a view)."""
    return t[0].unflatten(1, (n, -1)).transpose(0, 1)


def _write(kv, window, write_index, span, key_states, value_states):
    """Scatter ``[rows, heads, m, d]`` keys and values into one layer's buffer ``kv [2, slots,
    heads, capacity, d]`` at slots ``window`` and columns ``write_index``; returns the rows'
    first ``span`` columns (views) to attend over."""
    lo, hi = window
    idx = write_index.expand_as(key_states)  # [B, heads, n, d]: column of every written entry
    k, v = kv[0, lo:hi], kv[1, lo:hi]  # [B, heads, capacity, d] views of the forward's slots
    k.scatter_(2, idx, key_states)
    v.scatter_(2, idx, value_states)
    return k[:, :, :span], v[:, :, :span]


@dataclasses.dataclass
class Piece:
    """A prefill piece riding in a verify forward (:meth:`SlotKVCache.begin_piece`): the
    forward's tokens are one flattened row, the verify's ``split`` tokens (``B x n``) first,
    then the piece's ``rows x T``. The cache writes each part into its own slots; the attention
    (``redraft.infer.runner.grouped_attention``) attends the piece's queries over ``key`` / ``value``
    (this layer's, set by the cache's update) with ``bias``."""

    window: tuple[int, int]  # the piece rows' slots
    write_index: torch.Tensor  # [rows, 1, T, 1] columns the piece writes
    span: int  # columns the piece attends over
    split: int  # the verify's tokens, before the piece's in the forward
    rows: int
    T: int
    bias: torch.Tensor | None = None  # [rows, 1, T, span] additive
    key: torch.Tensor | None = None  # the current layer's [rows, kv_heads, span, d]
    value: torch.Tensor | None = None


@dataclasses.dataclass
class Ragged:
    """A prefill forward of rows of different lengths as one flattened row, no padding
    (:meth:`SlotKVCache.begin_ragged`): row ``b``'s ``lens[b]`` tokens follow row ``b - 1``'s
    (from ``offsets[b]``), are written to slot ``first + b`` at columns ``starts[b] ..``, and
    attend over that slot's columns before them and causally over their own
    (``redraft.infer.runner.grouped_attention``, one call per row)."""

    first: int  # the first row's slot
    starts: list[int]  # tokens each row already holds
    lens: list[int]  # tokens each row gets in this forward
    offsets: list[int]  # where each row's tokens begin in the flattened forward
    key: list | None = None  # the current layer's per row: [1, kv_heads, start + len, d] views
    value: list | None = None


class _SlotLayer(CacheLayerMixin):
    """One layer's view into the shared buffer (transformers' cache-layer protocol): per-row
    writes at each row's own length."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: SlotKVCache, idx: int):
        super().__init__()
        self.cache, self.idx = cache, idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):  # pragma: no cover - preallocated
        pass

    def get_max_length(self) -> int:
        return -1

    def update(self, key_states, value_states, *args, **kwargs):
        c = self.cache
        if c.ragged is not None:  # one flattened row, row b's tokens at offsets[b] (Ragged)
            return self._write_ragged(c.ragged, key_states, value_states)
        piece = c.piece
        if piece is not None:  # one forward, two parts: [1, heads, B n + m T, d] (Piece)
            split = piece.split
            piece.key, piece.value = _write(
                c.kv[self.idx],
                piece.window,
                piece.write_index,
                piece.span,
                _rows(key_states[:, :, split:], piece.rows),
                _rows(value_states[:, :, split:], piece.rows),
            )
            B = c.window[1] - c.window[0]
            key_states = _rows(key_states[:, :, :split], B)
            value_states = _rows(value_states[:, :, :split], B)
        return _write(c.kv[self.idx], c.window, c.write_index, c.span, key_states, value_states)

    def _write_ragged(self, ragged: Ragged, key_states, value_states):
        kv = self.cache.kv[self.idx]
        ragged.key, ragged.value = [], []
        for b, (s, n, o) in enumerate(zip(ragged.starts, ragged.lens, ragged.offsets)):
            slot = ragged.first + b
            kv[0, slot, :, s : s + n] = key_states[0, :, o : o + n]
            kv[1, slot, :, s : s + n] = value_states[0, :, o : o + n]
            ragged.key.append(kv[0, slot : slot + 1, :, : s + n])
            ragged.value.append(kv[1, slot : slot + 1, :, : s + n])
        return key_states, value_states  # (the attention reads ragged.key / ragged.value)

    @property
    def keys(self):
        lo, hi = self.cache.window
        return self.cache.kv[self.idx, 0, lo:hi, :, : self.cache.span]

    @keys.setter
    def keys(self, value):
        pass

    @property
    def values(self):
        lo, hi = self.cache.window
        return self.cache.kv[self.idx, 1, lo:hi, :, : self.cache.span]

    @values.setter
    def values(self, value):
        pass

    def get_mask_sizes(self, query_length: int):
        return self.cache.span, 0

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()


class SlotKVCache(Cache):
    """The target's KV cache for decoding: fixed slots and capacity, no holes, no per-step moves.

    ``kv [layers, 2, slots, kv_heads, capacity, head_dim]`` is allocated once (it grows by
    doubling only when a request needs more rows or columns than it has, which drops the
    captured graphs over it). The batch's active rows are slots ``0 .. B-1`` (rows leaving are
    compacted in place, rows joining are prefilled straight into the next free slots, rows
    prefilled in pieces wait in parked slots above those); row ``b``
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
        cfg = (
            model_config.get_text_config()
            if hasattr(model_config, "get_text_config")
            else model_config
        )
        self.num_layers = int(cfg.num_hidden_layers)
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.kv = zeroed(
            (self.num_layers, 2, max(slots, 1), heads, capacity, head_dim), dtype, device
        )
        self.batch = 0  # active rows (slots 0..batch-1)
        self.host_lengths: list[int] = []
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)
        self.window = (0, 0)  # slots the current forward runs over
        self.span = 0  # columns the current forward attends over
        self.high = 0  # columns any forward has attended over (written ones among them)
        self.fed = 0  # tokens per row the current forward writes
        self.write_index: torch.Tensor | None = None  # [B, 1, n, 1] columns the forward writes
        self.piece: Piece | None = None  # a prefill piece in the current forward (begin_piece)
        self.ragged: Ragged | None = None  # a flattened prefill forward (begin_ragged)
        self.generation = (
            0  # bumped whenever `kv` is reallocated (captured graphs hold its address)
        )
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
        """Columns before the current forward's tokens (transformers places its queries after
        them when it builds a causal mask itself)."""
        return self.span - self.fed

    def _grown(self, slots: int, capacity: int) -> tuple:
        """The buffer shape for ``slots`` x ``capacity`` (doubling what must grow)."""
        new_slots = max(slots, self.slots * 2 if slots > self.slots else self.slots)
        new_cap = max(capacity, self.capacity * 2 if capacity > self.capacity else self.capacity)
        return (*self.kv.shape[:2], new_slots, self.kv.shape[3], new_cap, self.kv.shape[5])

    def reserve(
        self, slots: int, capacity: int, used: Callable[[], dict[int, int]] | None = None
    ) -> bool:
        """Make room for ``slots`` rows of ``capacity`` columns (a new buffer: on a CPU its pages
        are zeroed as they are first touched, see :func:`zeroed`); returns whether the buffer
        moved. ``used()``: slot -> columns that hold data (the engine knows its rows' lengths),
        asked only when the buffer grows: only those are copied; default: every slot's columns
        any forward wrote. After a long
        prompt joined, the default copies every slot up to its length (3 GB and seconds on a
        small CPU for 17 slots of the default target in float32, touching every page)."""
        if slots <= self.slots and capacity <= self.capacity:
            return False
        new = zeroed(self._grown(slots, capacity), self.kv.dtype, self.kv.device)
        if used is None:
            c = min(self.high, self.capacity)  # columns any forward wrote: the rest are zeros
            new[:, :, : self.slots, :, :c] = self.kv[:, :, :, :, :c]
        else:
            for slot, c in used().items():
                if c > 0:
                    new[:, :, slot, :, :c] = self.kv[:, :, slot, :, :c]
        self.kv = new
        self.generation += 1
        return True

    def begin(
        self, lengths: torch.Tensor, n: int, span: int, rows: tuple[int, int] | None = None
    ) -> None:
        """Set up a forward of ``n`` tokens per row over slots ``rows`` (default: the batch) whose
        rows hold ``lengths [B]`` tokens (device), attending over the first ``span`` columns."""
        self.window = rows or (0, self.batch)
        self.lengths = lengths
        self.write_index = (lengths[:, None] + torch.arange(n, device=lengths.device)[None])[
            :, None, :, None
        ]
        self.span = span
        self.high = max(self.high, span)
        self.fed = n
        self.piece = self.ragged = None

    def begin_piece(self, starts: torch.Tensor, T: int, span: int, rows: tuple[int, int]) -> Piece:
        """After :meth:`begin` (a verify of ``B x n`` tokens): the same forward also carries a
        prefill piece of ``T`` tokens for each of slots ``rows``, whose rows hold ``starts``
        tokens (device), attending over ``span`` columns (one weight pass for both: on a CPU a
        forward's fixed cost is reading every weight). Returns the piece (its ``bias`` is the
        caller's to set); :meth:`begin` ends it."""
        B = self.window[1] - self.window[0]
        self.piece = Piece(
            window=rows,
            write_index=(starts[:, None] + torch.arange(T, device=starts.device)[None])[
                :, None, :, None
            ],
            span=span,
            split=B * self.fed,
            rows=rows[1] - rows[0],
            T=T,
        )
        self.high = max(self.high, span)
        return self.piece

    def begin_ragged(self, starts: list[int], lens: list[int], first: int) -> Ragged:
        """Set up a prefill forward of rows of ``lens[b]`` tokens each, flattened into one row
        with no padding (:class:`Ragged`), for slots ``first ..``, whose rows hold ``starts``
        tokens (host ints). The caller ends it (``cache.ragged = None``) after the forward."""
        offsets = [0]
        for n in lens[:-1]:
            offsets.append(offsets[-1] + n)
        self.window = (first, first + len(lens))
        self.span = max(s + n for s, n in zip(starts, lens))
        self.high = max(self.high, self.span)
        self.fed = 0
        self.piece = None
        self.ragged = Ragged(first, list(starts), list(lens), offsets)
        return self.ragged

    def attention_bias(
        self,
        anc: torch.Tensor,
        dtype,
        columns: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        span: int | None = None,
    ) -> torch.Tensor:
        """Additive mask ``[B, 1, n, span]`` for the current forward: row b's token i sees cache
        columns ``< lengths[b]`` and the tree columns ``lengths[b] + m`` of its ancestors m
        (``anc [B, n, n]`` bool, ``anc[b, i, m]``). ``columns``: ``arange(span)`` if cached.
        ``lengths`` / ``span``: another part's (a prefill piece's), default the forward's."""
        B, n, _ = anc.shape
        lengths = self.lengths if lengths is None else lengths
        span = self.span if span is None else span
        c = torch.arange(span, device=anc.device) if columns is None else columns
        rel = c[None, :] - lengths[:, None]  # [B, span]: tree node of each column, < 0 = cache
        tree = anc.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(B, n, span))  # [B, n, span]
        vis = (rel < 0)[:, None, :] | (tree & (rel < n)[:, None, :])
        return torch.zeros(vis.shape, dtype=dtype, device=vis.device).masked_fill_(
            ~vis, torch.finfo(dtype).min
        )[:, None]

    def commit_moves(self, rows: list[int], src: list[int], dst: list[int]) -> None:
        """Move entries ``(row, src column) -> (row, dst column)`` for every layer (host lists;
        one upload, one gather, one scatter)."""
        if not rows:
            return
        idx = torch.tensor([rows, src, dst], dtype=torch.long).to(self.kv.device, non_blocking=True)
        self.kv[:, :, idx[0], :, idx[2]] = self.kv[:, :, idx[0], :, idx[1]]

    def keep_rows(self, keep: list[int], columns: int | None = None) -> None:
        """Rows ``keep`` (indices of active rows, in their new order) stay, in slots
        0..len-1; the others are dropped. Slots past the batch (rows being prefilled) are left
        as they are.

        Only rows whose slot changes are copied, and only their first ``columns`` columns (what
        any moved row holds; default: the whole capacity): a row leaving a batch of long rows
        must not copy every row's whole cache (gigabytes on a CPU after a long prompt joined).
        The caller picks orders that move few rows (``Engine._retire``)."""
        dst = [t for t, s in enumerate(keep) if s != t]
        if dst:
            src = torch.tensor([keep[t] for t in dst], dtype=torch.long).to(self.kv.device)
            c = self.capacity if columns is None else min(int(columns), self.capacity)
            # the right side is gathered into a new tensor first: overlapping moves are safe
            self.kv[:, :, dst, :, :c] = self.kv[:, :, src, :, :c]
        self.host_lengths = [self.host_lengths[i] for i in keep] if self.host_lengths else []
        self.batch = len(keep)

    def move_row(self, src: int, dst: int, columns: int) -> None:
        """Copy slot ``src``'s first ``columns`` columns to slot ``dst`` (every layer)."""
        if src != dst and columns > 0:
            self.kv[:, :, dst, :, :columns] = self.kv[:, :, src, :, :columns]

    def add_rows(self, n: int) -> None:
        """``n`` empty rows after the active ones (the caller fills them)."""
        self.reserve(self.batch + n, self.capacity)
        self.lengths = torch.cat([self.lengths[: self.batch], self.lengths.new_zeros(n)])
        self.batch += n
