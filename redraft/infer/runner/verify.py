"""The target's forwards for decoding: prefill, tree verification, logits, and their cost.

:class:`Verifier` is everything the decoder asks of the target model. It hides how the forward
runs fast on each device: on CPU, faster weight layouts for multi-token forwards
(``redraft.models.cpu``: oneDNN-packed float32 linears and a contiguous LM head, used only
inside these forwards); on CUDA, a static-shape verify captured once per (batch, tree size) in a
CUDA graph and replayed (``static=True``, the default there).

What one verify forward gets is one packed tensor, :class:`StepInput` (the host builds the tree
and uploads it in one copy): per row the cache length, then the tree's tokens, depths, parents
and ancestor mask. Everything the model needs is derived from it *inside* the forward (ids,
positions ``length + depth``, the 4D attention mask, the columns the cache writes), so on CUDA
the whole verify, mask included, is one graph launch, and the step outside it is a handful of
ops (``redraft.infer.runner.opcount`` counts them).

Graphs (:class:`GraphSet`) belong to the cache they were captured over (its buffer address is in
them): one set per :class:`~redraft.infer.runner.kv.SlotKVCache`, with its own memory pool,
captured once per shape, dropped together when the buffer grows; a shape is captured the second
step in a row it is used or at its third use (``GraphStore``: a server's batch changes often, a
speculating engine's tree size alternates). **A capture that fails never changes or stops
decoding**: logged once, that shape stays eager (a CPU test injects a failing capture).

Attention backend: an explicit tree mask (no FlashAttention); on CUDA the forwards run under
``sdpa_kernel([EFFICIENT_ATTENTION, MATH])``, not cuDNN's SDPA, which builds a new plan for every
masked shape (~30 ms of CPU per call; docs/infer.md, "Attention backend").
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch

from redraft.infer.runner import tree_attention
from redraft.infer.runner.cost import SIZES, CostCurve, measure_cost_curve
from redraft.infer.runner.graphs import GraphStore, after_failed_capture, cuda_capture, graph_stats
from redraft.infer.runner.grouped_attention import NAME as ATTENTION
from redraft.infer.runner.grouped_attention import (
    grouped,
    row_groups,
    use_packed_attention,
    with_piece,
)
from redraft.infer.runner.kv import SlotKVCache
from redraft.infer.runner.opcount import not_counted
from redraft.infer.runner.ragged import prefill_ragged
from redraft.infer.runner.sdpa import sdpa_backends
from redraft.infer.runner.step_input import StepInput, chain_step
from redraft.models import cpu, lean, siblings
from redraft.utils import cache_kwargs

log = logging.getLogger(__name__)

# tree sizes (root included) a static verify pads to: one captured graph each
STATIC_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_SPAN = 256  # the shortest span a bucketed static verify attends over (span_buckets)


class GraphSet(GraphStore):
    """The CUDA graphs captured over one cache buffer and their memory pool (one owner, one
    lifetime): ``entries[(batch, size, span)]``, shapes whose capture failed in ``eager``, and
    the buffer generation they were captured over (:class:`~redraft.infer.runner.graphs.GraphStore`:
    the capture policy and the cap on graphs kept)."""

    def __init__(self, max_graphs: int = 256):
        super().__init__(max_graphs)
        self.generation = -1  # the cache buffer generation the entries were captured over

    def clear(self, forget_failures: bool = False) -> None:
        """Drop every graph and the pool; a shape whose capture failed stays eager."""
        super().clear(forget_failures)


class Verifier:
    """Target forwards over a :class:`~redraft.infer.runner.kv.SlotKVCache`.

    Args:
        target: a :class:`redraft.models.Target`.
        fp32_logits: compute logits with a float32 LM head (bf16 targets: fewer near-tie flips).
        cpu_pack: on CPU, use ``redraft.models.cpu``'s faster layouts (the model is not
            modified; derived weights are shared by every verifier over the model).
        static: pad trees to :data:`STATIC_SIZES` and attend over the cache's whole capacity
            (shapes and addresses that do not change from step to step: the precondition of graph
            capture on CUDA).
        graphs: capture static verifies in CUDA graphs (default: ``static`` on CUDA).
        capture: the capture function (``cuda_capture``); tests inject their own.
        span_buckets: with ``static``, attend over the shortest power-of-two span (at least
            :data:`MIN_SPAN` columns) holding the longest row instead of the whole capacity
            (:meth:`static_span`; one graph per span).
        lean_walk: on CPU in float32, run Llama-family targets' forwards as a walk over their
            layers with the same kernels and numbers (``redraft.models.lean``); ``False``:
            transformers' forward.
        compiled_attention: on CPU in float32, forwards of a few tokens per row attend with
            ``redraft.infer.runner.tree_attention`` where it pays (its ``pays``).
    """

    def __init__(
        self,
        target,
        fp32_logits: bool = False,
        cpu_pack: bool = True,
        static: bool = False,
        graphs: bool | None = None,
        capture=None,
        span_buckets: bool = False,
        lean_walk: bool = True,
        compiled_attention: bool = True,
    ):
        self.target = target
        self.span_buckets = span_buckets
        self.max_graphs = 256  # graphs a cache keeps (GraphSet; least recently replayed dropped)
        self.model = target.model
        self.base = getattr(self.model, self.model.base_model_prefix)
        self.device, self.dtype = target.device, target.dtype
        self.static = static
        head = target.output_head
        head_dtype = torch.float32 if fp32_logits else head.weight.dtype
        self._head_b = None if head.bias is None else head.bias.detach().to(head_dtype)
        self._head_packed, self._packs = None, {}
        self._groups: list = []  # sibling linears and their kernels at 1-2 rows (CPU float32)
        # the decoder layers walked without transformers' module calls (models/lean.py)
        self._lean: lean.LeanForward | None = None
        # the rows (tokens) from which the packed kernels run: measured on this CPU at 1-2 rows
        self.packed_rows = self.head_packed_rows = (cpu.MIN_PACKED_ROWS, cpu.MAX_PACKED_ROWS)
        if cpu_pack and head.weight.device.type == "cpu":
            self._head_wt, self._head_packed = cpu.head_weights(head, head_dtype)  # [H, V]
            if target.dtype == torch.float32:
                cpu.plan_row_padding(self.base)  # first: the kernel plans below time with it
                self._groups = siblings.traced_groups(self.base)
                grouped = {layer for g in self._groups for layer in g.layers}
                self._packs = cpu.pack_linears(self.base, exclude=grouped)
                self._lean = lean.LeanForward.build(self.base, self._groups) if lean_walk else None
            hi = cpu.MAX_PACKED_ROWS
            lo = cpu.MIN_PACKED_ROWS if self._groups else cpu.packed_from(self._packs)
            self.packed_rows = (lo, hi)
            self.head_packed_rows = (
                cpu.head_packed_from(head, self._head_wt, self._head_packed),
                hi,
            )
            log.info("CPU kernels: %s", self.kernels or "the default ones")
        else:
            self._head_wt = head.weight.detach().to(head_dtype).T  # [H, V] view
        self.forward_seconds = 0.0  # wall time inside forwards (synchronised), when `timing`
        self.timing = False
        self.graphs = static and self.device.type == "cuda" if graphs is None else graphs
        self.capture = capture or cuda_capture
        # Lower layers whose hidden states the forwards also return, before the last one:
        # ``[..., (len + 1) * H]`` = [layer a | layer b | ... | last]; () = the last only (set by
        # the decoder before the first forward, for multi-layer ReDrafter heads)
        self.hidden_layers: tuple[int, ...] = ()
        self._warned = False
        self._padded: tuple = (None, {})  # (curve, tree_size's choices under it)
        # how the static verifies ran (``redraft-bench`` reports them: on a GPU a capture costs
        # a few eager forwards, and an eager static forward far more than a replay)
        self.graph_stats = graph_stats()
        self._attention = sdpa_backends(self.device)
        # every device: the query heads of a key/value head attend packed (no per-head copy of
        # the cache); CPU eager forwards: rows of very different lengths attend in runs
        packed = use_packed_attention(self.model)
        self._grouped = packed and not static and self.device.type == "cpu"
        # CPU: prefill forwards are one flattened row of the prompts' tokens, no padding
        self.ragged_prefill = self._grouped
        self._compiled = (
            compiled_attention
            and self._grouped
            and self.dtype == torch.float32
            and tree_attention.available()
        )

    @property
    def kernels(self) -> str:
        """Which packed CPU kernels the forwards use, from how many tokens ("" for none)."""
        parts = siblings.describe(self._groups)
        if self._packs or any(g.packed is not None for g in self._groups):
            n = self.packed_rows[0]
            parts.append(f"float32 linears packed from {n} token{'s' if n > 1 else ''}")
        if self._head_packed is not None:
            parts.append(f"LM head from {self.head_packed_rows[0]}")
        if parts and (pad := cpu.row_padding()):  # (parts: something runs packed)
            parts.append("packed " + " ".join(f"{m}->{n}" for m, n in pad.items()) + " rows")
        if self._lean is not None:
            parts.append("lean walk")
        return ", ".join(parts)

    # ------------------------------------------------------------------ shapes

    def tree_size(
        self, nodes: int, limit: int | None = None, curve: CostCurve | None = None
    ) -> int:
        """Packed tree size for ``nodes`` nodes (root included): the next static size, but not
        above ``limit`` (the largest static size that fits, else ``limit``); ``nodes`` itself
        when shapes are dynamic. With a one-row cost ``curve``, a larger size that measured at
        least 5% cheaper (``curve.raw``: a kernel slow at this shape, or a noisy measurement)
        is taken instead: the tree is filled up to it with more candidates, so it costs less
        and verifies more (the curve's envelope already prices this size at that cost)."""
        size = nodes
        if self.static:
            size = next((s for s in STATIC_SIZES if s >= nodes), nodes)
            if limit is not None and size > limit:
                size = max((s for s in STATIC_SIZES if s <= limit), default=limit)
        if curve is None:
            return size
        if curve is not self._padded[0]:  # every step asks: remembered per size and curve
            self._padded = (curve, {})
        memo = self._padded[1]
        if (size, limit) not in memo:
            memo[size, limit] = self._cheapest(curve, size, limit)
        return memo[size, limit]

    def _cheapest(self, curve: CostCurve, size: int, limit: int | None) -> int:
        sizes, raw = curve.sizes.tolist(), curve.raw.tolist()  # (no tensor op: host work only)
        cands = [
            (c, int(m))
            for m, c in zip(sizes, raw)
            if m > size and (limit is None or m <= limit) and (not self.static or m in STATIC_SIZES)
        ]
        if cands:
            here = float(np.interp(size, sizes, raw))
            cheapest = min(cands)
            if cheapest[0] < 0.95 * here:
                return cheapest[1]
        return size

    def new_cache(self, slots: int, capacity: int) -> SlotKVCache:
        cache = SlotKVCache(self.model.config, slots, capacity, self.dtype, self.device)
        cache.graph_set = GraphSet(self.max_graphs)
        return cache

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ forwards

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` final hidden states (or the forwards' ``[..., F]`` features, whose last H
        columns they are) -> ``[..., V]`` logits."""
        if self.hidden_layers:
            hidden = hidden[..., -self._head_wt.shape[0] :]
        h = hidden.to(self._head_wt.dtype)
        rows = h.numel() // h.shape[-1]
        lo, hi = self.head_packed_rows
        if self._head_packed is not None and lo <= rows <= hi:
            return cpu.packed_linear(h, self._head_packed, self._head_b)
        out = h @ self._head_wt
        return out if self._head_b is None else out + self._head_b

    def _model(self, ids, positions, bias, cache) -> torch.Tensor:
        if self._lean is not None and bias is not None and bias.dim() == 4:
            with self._attention:
                return self._lean(ids, positions, bias, cache, self.packed_rows, self.hidden_layers)
        extra = {"output_hidden_states": True} if self.hidden_layers else {}
        with self._attention, cpu.use_packed(self._packs, self.packed_rows, self._groups):
            out = self.base(
                input_ids=ids,
                attention_mask=bias,
                position_ids=positions,
                use_cache=True,
                **cache_kwargs(self.base, cache),
                **extra,
            )
        if self.hidden_layers:  # [B, n, (k+1) * H]: the lower layers' states, then the last
            return torch.cat(
                [out.hidden_states[i] for i in self.hidden_layers] + [out.last_hidden_state], -1
            )
        return out.last_hidden_state  # [B, n, H] after the final norm

    def static_span(self, cache: SlotKVCache, n: int) -> int:
        """Columns a static verify of ``n`` tokens per row attends over: the whole capacity, or
        with :attr:`span_buckets` the shortest power of two (>= :data:`MIN_SPAN`) that holds the
        longest row's cache and tree. A graph captured at a span serves every step whose rows
        fit it: the columns past a row's length are masked whatever the span."""
        if not self.span_buckets:
            return cache.capacity
        need, span = cache.physical + n, MIN_SPAN
        while span < need:
            span *= 2
        return min(span, cache.capacity)

    def _tree_forward(
        self, step: StepInput, cache: SlotKVCache, static: bool, span: int | None = None
    ) -> torch.Tensor:
        """The verify forward, everything derived from ``step`` inside it (one graph on CUDA).
        ``span``: the columns a static forward attends over (default :meth:`static_span`)."""
        with not_counted():
            N = step.size
            lengths = step.lengths
            if static:
                span = span or self.static_span(cache, N)
            else:
                span = min(cache.capacity, cache.physical + N)
            cache.begin(lengths, N, span)
            anc = step.anc.bool()
            bias = cache.attention_bias(anc, self.dtype)
            if self._compiled and tree_attention.pays(len(lengths), N):  # no runs to plan
                groups, rows = None, tree_attention.with_tree(lengths.numpy(), anc.numpy())
            else:
                groups = row_groups(cache.host_lengths, N) if self._grouped else None
                rows = contextlib.nullcontext()
            with grouped(groups), rows:
                return self._model(
                    step.tokens.clamp_min(0), lengths[:, None] + step.depth, bias, cache
                )

    def prefill(
        self,
        prompts: list[list[int]],
        cache: SlotKVCache,
        first_slot: int = 0,
        starts: list[int] | None = None,
    ) -> torch.Tensor:
        """Run token pieces into slots ``first_slot ..`` of ``cache``; returns each row's hidden
        state after its last piece token ``[n, H]``. The caller sets ``cache.host_lengths`` for
        these rows afterwards. With :attr:`ragged_prefill` (CPU) the pieces are one flattened
        row, no padding (:func:`~redraft.infer.runner.ragged.prefill_ragged`); else right-padded
        rows.

        ``starts[b]``: tokens row b already holds (default 0, a whole prompt): its piece is a
        later chunk of its prompt (chunked prefill), at positions ``starts[b] + i``, seeing its
        cache columns ``< starts[b]`` and its own piece causally. Padding tokens past a short
        piece are written after it (columns the row later overwrites; no row ever sees them)."""
        if self.ragged_prefill:
            with not_counted(), _Timer(self) if self.timing else contextlib.nullcontext():
                return prefill_ragged(self._model, prompts, cache, first_slot, starts)
        ids, plen, start, pos, causal = self._piece_inputs(prompts, starts)
        B, T = ids.shape
        with not_counted(), _Timer(self) if self.timing else contextlib.nullcontext():
            cache.begin(start, T, span=max(starts or [0]) + T, rows=(first_slot, first_slot + B))
            hid = self._model(ids, pos, cache.attention_bias(causal, self.dtype), cache)
        return hid[torch.arange(B, device=self.device), plen - 1]

    def _piece_inputs(self, prompts: list[list[int]], starts: list[int] | None) -> tuple:
        """``(ids [n, T], lengths [n], starts [n], positions [n, T], causal [n, T, T])`` on the
        device for right-padded pieces (``causal[b, i, m]``: token i sees token m of its own
        piece)."""
        dev = self.device
        B, T = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((B, T), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        plen = torch.tensor([len(p) for p in prompts]).to(dev)
        start = torch.tensor(starts or [0] * B, dtype=torch.long).to(dev)
        ar = torch.arange(T, device=dev)
        causal = (ar[None, :, None] >= ar[None, None, :]) & (
            ar[None, None, :] < plen[:, None, None]
        )  # [B, T, T]
        return ids.to(dev), plen, start, start[:, None] + ar[None], causal

    @property
    def can_fuse(self) -> bool:
        """Whether :meth:`verify_with_piece` runs: eager verifies (no graphs) through redraft's
        attention (:func:`~redraft.infer.runner.grouped_attention.grouped_sdpa`)."""
        return not self.static and self.model.config._attn_implementation == ATTENTION

    def verify_with_piece(
        self,
        step: StepInput,
        cache: SlotKVCache,
        prompts: list[list[int]],
        first_slot: int,
        starts: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`verify` of ``step`` and :meth:`prefill` of ``prompts`` into slots
        ``first_slot ..`` in one forward (chunked prefill's piece beside the running rows' step,
        as vLLM and SGLang batch them): the tokens of both are one flattened row, so every
        weight is read once (a CPU forward's fixed cost, ~47-64 ms for the default target on
        a small CPU, is that read) and no part is padded to the other's length; the
        attention and the cache take the two parts apart (:class:`~redraft.infer.runner.kv.Piece`).
        Returns the verify's hidden ``[B, N, F]`` and the piece rows' last hidden ``[n, F]``;
        the same values as the two forwards (up to the matrix products' summation order).
        Eager only (:attr:`can_fuse`)."""
        ids, plen, start, piece_pos, causal = self._piece_inputs(prompts, starts)
        n, T = ids.shape
        B, N = step.tokens.shape
        with not_counted(), _Timer(self) if self.timing else contextlib.nullcontext():
            lengths = step.lengths
            cache.begin(lengths, N, min(cache.capacity, cache.physical + N))
            bias = cache.attention_bias(step.anc.bool(), self.dtype)
            span = max(starts) + T
            piece = cache.begin_piece(start, T, span, (first_slot, first_slot + n))
            piece.bias = cache.attention_bias(causal, self.dtype, lengths=start, span=span)
            groups = row_groups(cache.host_lengths, N) if self._grouped else None
            flat_ids = torch.cat([step.tokens.clamp_min(0).reshape(-1), ids.reshape(-1)])
            pos = torch.cat([(lengths[:, None] + step.depth).reshape(-1), piece_pos.reshape(-1)])
            try:
                with grouped(groups), with_piece(piece):
                    hid = self._model(flat_ids[None], pos[None], bias, cache)[0]  # [B N + n T, F]
            finally:
                cache.piece = None
        last = hid[B * N :].view(n, T, -1)[torch.arange(n, device=self.device), plen - 1]
        return hid[: B * N].view(B, N, -1), last

    def verify(self, step: StepInput, cache: SlotKVCache) -> torch.Tensor:
        """One forward over the packed trees of ``step``; returns hidden ``[B, N, H]`` (``[B, N,
        F]`` with :attr:`hidden_layers`; :meth:`logits` reads the last H columns) (the tree
        tokens' keys and values are written at each row's length, to be committed; with a
        captured graph the tensor is the graph's output buffer, valid until the next verify)."""
        if not self.static:
            with _Timer(self) if self.timing else contextlib.nullcontext():
                return self._tree_forward(step, cache, static=False)
        span = self.static_span(cache, step.size)
        key = (cache.batch, step.size, span)
        graphs: GraphSet = cache.graph_set
        if graphs.generation != cache.generation:  # the buffer moved: its graphs are stale
            graphs.clear()
            graphs.generation = cache.generation
        entry, capture = graphs.lookup(key)
        if capture and self.graphs:
            entry = self._capture(key, step, cache, graphs)
        if entry is None:
            self.graph_stats["eager"] += 1
            with _Timer(self) if self.timing else contextlib.nullcontext():
                return self._tree_forward(step, cache, static=True, span=span)
        self.graph_stats["replays"] += 1
        entry["step"].packed.copy_(step.packed)
        with _Timer(self) if self.timing else contextlib.nullcontext():
            entry["graph"].replay()
        return entry["out"]

    def _capture(self, key, step: StepInput, cache: SlotKVCache, graphs: GraphSet) -> dict | None:
        """Capture the verify forward for this shape over static input buffers; ``None`` (and
        the shape stays eager) if the capture fails for any reason."""
        static = StepInput(step.packed.clone(), step.size)
        timing, self.timing = self.timing, False  # no synchronising inside a capture
        t0 = time.perf_counter()
        try:
            if graphs.pool is None and self.device.type == "cuda":
                graphs.pool = torch.cuda.graph_pool_handle()
            graph, out = self.capture(
                lambda: self._tree_forward(static, cache, static=True, span=key[2]),
                self.device,
                graphs.pool,
            )
        except Exception as exc:  # noqa: BLE001 - any capture failure must leave decoding intact
            self.graph_stats["failed"] += 1
            graphs.failed(key)
            what = f"the verify forward for batch {key[0]}, tree size {key[1]}"
            after_failed_capture(self.device, what, exc, self._warned)
            self._warned = True
            return None
        finally:
            self.timing = timing
        self.sync()  # (a capture is rare: its whole cost, the warm-up forwards included)
        self.graph_stats["captures"] += 1
        self.graph_stats["capture_s"] += time.perf_counter() - t0
        entry = {"step": static, "graph": graph, "out": out}
        self.graph_stats["dropped"] += graphs.add(key, entry)
        return entry

    # ------------------------------------------------------------------ cost

    @torch.no_grad()
    def measure_cost(self, max_nodes: int = 64, context: int = 256, sizes=None) -> CostCurve:
        """Measure the verify-cost curve on this device: one row over a ``context``-token cache,
        trees of ``sizes`` tokens (up to ``max_nodes + 1``), logits included."""
        sizes = [s for s in (sizes or SIZES) if s <= max(max_nodes + 1, 1)] or [1]
        if sizes[-1] < max_nodes + 1:
            sizes.append(max_nodes + 1)
        cache = self.new_cache(1, context + max(sizes) + 1)
        self.prefill([[0] * context], cache)
        cache.batch, cache.host_lengths = 1, [context]

        def fwd(n):
            self.logits(self.verify(chain_step([context], n, self.device), cache))

        curve = measure_cost_curve(fwd, sizes, sync=self.sync)
        if self.graphs:  # prefills run eagerly: their fixed cost is not a replay's
            curve.prefill_c0 = self.prefill_fixed_cost(cache, context)
        return curve

    @torch.no_grad()
    def prefill_fixed_cost(self, cache: SlotKVCache | None = None, context: int = 0) -> float:
        """Seconds of an eager one-token prefill forward (its logits included) over ``context``
        cached tokens of ``cache`` (default: a scratch one-row cache): what any prefill forward
        costs before its tokens."""
        if cache is None:
            cache = self.new_cache(1, context + 2)
        one = measure_cost_curve(
            lambda _: self.logits(self.prefill([[0]], cache, starts=[context])), [1], sync=self.sync
        )
        return float(one.raw[0])


class _Timer:
    """Adds a forward's synchronised wall time to ``verifier.forward_seconds`` (benchmarks only:
    synchronising costs the GPU its run-ahead)."""

    def __init__(self, verifier: Verifier):
        self.v = verifier

    def __enter__(self):
        self.v.sync()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.v.sync()
        self.v.forward_seconds += time.perf_counter() - self.t0
