"""The target's forwards for decoding: prefill, tree verification, logits, and their cost.

:class:`Verifier` is everything the decoder asks of the target model. It hides how the forward
runs fast on each device: on CPU, faster weight layouts for multi-token forwards
(``redraft.models.cpu``: oneDNN-packed float32 linears and a contiguous LM head, used only
inside these forwards); on CUDA, optionally a static-shape verify whose forward is captured
once per tree size in a CUDA graph (``static=True``; see :meth:`Verifier.verify`).

A verify forward of ``n`` tree tokens attends to each row's cache (its own length) plus the
tree's ancestor mask, with positions ``cache length + depth`` (transformers models take a 4D
additive mask and explicit position ids with a KV cache).

Static verify (``static=True``, the default on CUDA): trees are padded to :data:`STATIC_SIZES`
and the cache runs in its static mode (writes at a device index, attends over its whole
capacity), so a verify forward has the same shapes and addresses every step. On CUDA it is then
captured in a CUDA graph per (batch, tree size, cache buffer) and replayed: one launch instead of
hundreds of kernel launches from Python. A shape is captured the second step in a row it is
used (rows joining or leaving a server's batch every step would otherwise cost a capture per
step); the eager forward runs until then. Outputs are the eager forward's (the same kernels on
the same inputs; a ``cuda`` test checks it).
"""

from __future__ import annotations

import contextlib

import torch

from redraft.infer.budget import SIZES, CostCurve, measure_cost_curve
from redraft.infer.kv import TreeKVCache
from redraft.infer.opcount import not_counted
from redraft.models import cpu

# tree sizes (root included) a static verify pads to: one captured graph each
STATIC_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class Verifier:
    """Target forwards over a :class:`TreeKVCache`.

    Args:
        target: a :class:`redraft.models.Target`.
        fp32_logits: compute logits with a float32 LM head (bf16 targets: fewer near-tie flips).
        cpu_pack: on CPU, use ``redraft.models.cpu``'s faster layouts (the model is not
            modified; derived weights are shared by every verifier over the model).
        static: pad trees to :data:`STATIC_SIZES` (shapes the caller can rely on without
            reading the device, and the precondition of graph capture on CUDA).
    """

    def __init__(self, target, fp32_logits: bool = False, cpu_pack: bool = True, static: bool = False,
                 graphs: bool | None = None):
        self.target = target
        self.model = target.model
        self.base = getattr(self.model, self.model.base_model_prefix)
        self.device, self.dtype = target.device, target.dtype
        self.static = static
        head = target.output_head
        head_dtype = torch.float32 if fp32_logits else head.weight.dtype
        self._head_b = None if head.bias is None else head.bias.detach().to(head_dtype)
        self._head_packed, self._packs = None, {}
        if cpu_pack and head.weight.device.type == "cpu":
            self._head_wt, self._head_packed = cpu.head_weights(head, head_dtype)  # [H, V]
            if target.dtype == torch.float32:
                self._packs = cpu.pack_linears(self.base)
        else:
            self._head_wt = head.weight.detach().to(head_dtype).T  # [H, V] view
        self.forward_seconds = 0.0  # wall time inside forwards (synchronised), when `timing`
        self.timing = False
        self.graphs = static and self.device.type == "cuda" if graphs is None else graphs
        self._last_key = None  # the previous verify's shape key (capture on a repeat)
        self._pool = None

    # ------------------------------------------------------------------ shapes

    def tree_size(self, nodes: int, limit: int | None = None) -> int:
        """Packed tree size for ``nodes`` nodes (root included): the next static size, but not
        above ``limit`` (the largest static size that fits, else ``limit``); ``nodes`` itself
        when shapes are dynamic."""
        if not self.static:
            return nodes
        size = next((s for s in STATIC_SIZES if s >= nodes), nodes)
        if limit is not None and size > limit:
            size = max((s for s in STATIC_SIZES if s <= limit), default=limit)
        return size

    def new_cache(self, batch: int, capacity: int) -> TreeKVCache:
        return TreeKVCache(self.model.config, batch, capacity, self.dtype, self.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ forwards

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` final hidden states -> ``[..., V]`` logits."""
        h = hidden.to(self._head_wt.dtype)
        rows = h.numel() // h.shape[-1]
        if self._head_packed is not None and cpu.MIN_PACKED_ROWS <= rows <= cpu.MAX_PACKED_ROWS:
            return cpu.packed_linear(h, self._head_packed, self._head_b)
        out = h @ self._head_wt
        return out if self._head_b is None else out + self._head_b

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor, cache) -> torch.Tensor:
        timer = contextlib.nullcontext()
        if self.timing:
            timer = _Timer(self)
        with timer, not_counted(), cpu.use_packed(self._packs):
            out = self.base(input_ids=ids, attention_mask=bias, position_ids=positions,
                            past_key_values=cache, use_cache=True)
        return out.last_hidden_state  # [B, n, H] after the final norm

    def prefill(self, prompts: list[list[int]], cache: TreeKVCache) -> torch.Tensor:
        """Run right-padded prompts (each row sees its own tokens only) into ``cache`` (empty,
        one row per prompt); returns each row's last hidden state ``[B, H]``."""
        dev = self.device
        B, T = len(prompts), max(len(p) for p in prompts)
        plen_host = [len(p) for p in prompts]
        plen = torch.tensor(plen_host, device=dev)
        ids = torch.zeros((B, T), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = torch.tensor(p)
        ids = ids.to(dev)
        ar = torch.arange(T, device=dev)
        causal = (ar[None, :, None] >= ar[None, None, :]) & (ar[None, None, :] < plen[:, None, None])
        cache.lengths = torch.zeros(B, dtype=torch.long, device=dev)
        cache.physical = 0
        hid = self._forward(ids, ar[None].expand(B, -1), cache.attention_bias(causal, self.dtype), cache)
        cache.set_prefill(plen, physical=max(plen_host))
        return hid[torch.arange(B, device=dev), plen - 1]

    def verify(self, tokens: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor,
               cache: TreeKVCache) -> torch.Tensor:
        """One forward over packed trees ``tokens [B, N]`` (``PAD`` allowed in padding nodes)
        with depths ``[B, N]`` and ancestor mask ``anc [B, N, N]``; returns hidden ``[B, N, H]``
        (the tokens' keys and values are appended to the cache, to be committed; with a static
        verify the tensor is the graph's output buffer, valid until the next verify)."""
        positions = cache.lengths[:, None] + depth
        ids = tokens.clamp_min(0)
        if not self.static:
            return self._forward(ids, positions, cache.attention_bias(anc, self.dtype), cache)
        n = tokens.shape[1]
        cache.ensure_capacity(cache.physical + n)  # before any address is captured
        cache.static = True
        try:
            cache.write_pos = cache.physical + torch.arange(n, device=tokens.device)
            bias = cache.attention_bias(anc, self.dtype)
            key = (cache.kv.data_ptr(), tuple(tokens.shape), cache.capacity)
            if self.graphs and (key in cache.graphs or key == self._last_key):
                self._last_key = key
                return self._replay(key, ids, positions, bias, cache)
            self._last_key = key
            return self._forward(ids, positions, bias, cache)
        finally:
            cache.static = False

    def _replay(self, key, ids, positions, bias, cache: TreeKVCache) -> torch.Tensor:
        """Replay (capturing first if needed) the verify forward for this shape and buffer."""
        entry = cache.graphs.get(key)
        if entry is None:
            entry = cache.graphs[key] = self._capture(ids, positions, bias, cache)
        entry["ids"].copy_(ids)
        entry["pos"].copy_(positions)
        entry["bias"].copy_(bias)
        entry["write_pos"].copy_(cache.write_pos)
        cache.write_pos = entry["write_pos"]
        if self.timing:
            with _Timer(self):
                entry["graph"].replay()
        else:
            entry["graph"].replay()
        cache.pending = ids.shape[1]
        return entry["out"]

    def _capture(self, ids, positions, bias, cache: TreeKVCache) -> dict:
        """Capture one verify forward over static input buffers (PyTorch's recipe: warm up on
        a side stream, then capture; the warm-up forwards write the same keys and values at the
        same columns as the real one, so they are harmless)."""
        entry = {"ids": ids.clone(), "pos": positions.clone(), "bias": bias.clone(),
                 "write_pos": cache.write_pos.clone()}
        timing, self.timing = self.timing, False  # no synchronising inside a capture
        cache.write_pos = entry["write_pos"]
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(entry["ids"], entry["pos"], entry["bias"], cache)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            entry["out"] = self._forward(entry["ids"], entry["pos"], entry["bias"], cache)
        entry["graph"] = graph
        self.timing = timing
        return entry

    # ------------------------------------------------------------------ cost

    @torch.no_grad()
    def measure_cost(self, max_nodes: int = 64, context: int = 256, sizes=None) -> CostCurve:
        """Measure the verify-cost curve on this device: one row over a ``context``-token cache,
        trees of ``sizes`` tokens (up to ``max_nodes + 1``)."""
        sizes = [s for s in (sizes or SIZES) if s <= max(max_nodes + 1, 1)] or [1]
        if sizes[-1] < max_nodes + 1:
            sizes.append(max_nodes + 1)
        dev = self.device
        cache = self.new_cache(1, context + max(sizes) + 1)
        self.prefill([[0] * context], cache)

        def fwd(n):
            anc = torch.tril(torch.ones((1, n, n), dtype=torch.bool, device=dev))
            h = self.verify(torch.zeros((1, n), dtype=torch.long, device=dev),
                            torch.arange(n, device=dev)[None], anc, cache)
            self.logits(h)
            cache.physical = context  # drop what this forward appended

        return measure_cost_curve(fwd, sizes, sync=self.sync)


class _Timer:
    """Adds a forward's synchronised wall time to ``verifier.forward_seconds`` (benchmarks only:
    synchronising costs the GPU its run-ahead)."""

    def __init__(self, verifier: Verifier):
        self.v = verifier

    def __enter__(self):
        import time

        self.v.sync()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        import time

        self.v.sync()
        self.v.forward_seconds += time.perf_counter() - self.t0
