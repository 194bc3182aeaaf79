"""Sibling linears run as one product: faster float32 CPU forwards at every token count.

Sibling layers are the linears one forward calls with the same input tensor, one after another:
a decoder layer's q, k and v projections, an MLP's gate and up projections. Their weights side
by side make one wider layer, and one call over it replaces two or three: fewer calls, and a
wider product the kernels run closer to the memory's speed. Each layer then returns its columns
of the shared output (a view; the first sibling called computes it, the others take theirs).

Three kernels, as in :mod:`redraft.models.cpu`:

- ``linear``: ``F.linear`` per layer, the model as it is;
- ``packed``: oneDNN's packed layout of the siblings' weights side by side (the packed weight
  of a single layer for a group of one): what every forward of 3 tokens and more runs with;
- ``fused``: ``x @ W.T`` with the siblings' ``W.T`` stored contiguously, ``[in, sum of outs]``:
  the row-vector product reads the weight in memory order, which at 1-2 tokens often beats
  both (docs/design/0013).

Which one runs 1 and 2 tokens is measured per group shape on this CPU
(:func:`plan_small_rows`); the transposed copy is kept only where it wins. The siblings are
found by tracing one forward (:func:`sibling_groups`), not by layer names, so any architecture
whose siblings share an input gets them.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from redraft.models.cpu import (
    MIN_PACKED_WEIGHT,
    _derived,
    pack_weight,
    packed_linear,
    packing_available,
)

logger = logging.getLogger(__name__)

SMALL_ROWS = (1, 2)  # forwards of these many rows run the kernel measured per group shape
KERNELS = ("linear", "packed", "fused")


class Group:
    """Sibling float32 linears (called with one input, in this order) and their kernels:
    ``kernel[rows]`` for :data:`SMALL_ROWS`, ``packed`` from there on where packing is
    available (``linear`` where not)."""

    def __init__(self, layers: list):
        self.layers = layers
        outs = [layer.weight.shape[0] for layer in layers]
        ends = [sum(outs[: i + 1]) for i in range(len(outs))]
        self.bounds = list(zip([0, *ends[:-1]], ends))  # each layer's columns of the output
        self.kernel: dict[int, str] = {}
        self.wt: torch.Tensor | None = None  # fused: [in, sum of outs], contiguous
        self.packed: torch.Tensor | None = None  # packed: the siblings' weights side by side
        self.bias: torch.Tensor | None = None
        # (input, kernel, output) of the current forward: the siblings called after the first
        # take their columns of it; cleared when the forward's use_packed block ends
        self._last = None

    @property
    def shape(self) -> tuple:
        return tuple((tuple(x.weight.shape), x.bias is not None) for x in self.layers)

    def _stamp(self) -> tuple:
        return tuple((x.weight.data_ptr(), x.weight._version) for x in self.layers)

    def _weight(self) -> torch.Tensor:
        return torch.cat([x.weight.detach() for x in self.layers])  # [sum of outs, in]

    def make(self, fused: bool, keep: bool = True) -> None:
        """The packed weight (where oneDNN is available) and, with ``fused``, the transposed
        copy: shared by every plan over these layers and made again when one of their weights
        changes; without ``keep``, this group's alone (for timing)."""

        def derive(kind, make):
            return _derived(self.layers[0], (kind, self._stamp()), make) if keep else make()

        if packing_available():
            self.packed = derive("packed-siblings", lambda: pack_weight(self._weight()))
        self.wt = derive("fused", lambda: self._weight().T.contiguous()) if fused else None
        if any(x.bias is not None for x in self.layers):
            self.bias = torch.cat(
                [
                    x.bias.detach() if x.bias is not None else x.weight.new_zeros(x.weight.shape[0])
                    for x in self.layers
                ]
            )

    def way(self, x: torch.Tensor, lo: int, hi: int) -> str:
        """The kernel that runs input ``x`` in a forward whose packed range is ``lo`` to ``hi``
        rows: the one measured for its row count, else ``packed`` in that range, ``linear``
        otherwise (and wherever the chosen kernel's weights were not made)."""
        if x.dtype != torch.float32 or x.requires_grad:
            return "linear"
        rows = x.numel() // max(x.shape[-1], 1)
        way = self.kernel.get(rows) or ("packed" if lo <= rows <= hi else "linear")
        if (way == "fused" and self.wt is not None) or (
            way == "packed" and self.packed is not None
        ):
            return way
        return "linear"

    def product(self, x: torch.Tensor, way: str) -> torch.Tensor:
        """Every sibling's output side by side (``way`` ``packed`` or ``fused``)."""
        if way == "packed":
            return packed_linear(x, self.packed, self.bias)
        if self.bias is None:
            return x @ self.wt
        flat = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.wt)
        return flat.reshape(*x.shape[:-1], -1)

    def outputs(self, x: torch.Tensor, lo: int, hi: int) -> list[torch.Tensor]:
        """Each sibling's output for input ``x`` (one product, or ``F.linear`` per layer where
        that is the kernel): what calling the layers one by one in a ``use_packed`` block
        gives, bit for bit."""
        way = self.way(x, lo, hi)
        if way == "linear":
            return [F.linear(x, layer.weight, layer.bias) for layer in self.layers]
        y = self.product(x, way)
        return [y[..., a:b] for a, b in self.bounds]

    def run(self, x: torch.Tensor, i: int, way: str) -> torch.Tensor:
        """Layer ``i``'s output, from one product over all siblings per input and kernel."""
        last = self._last
        if last is None or last[0] is not x or last[1] != way:
            last = self._last = (x, way, self.product(x, way))
        lo, hi = self.bounds[i]
        return last[2][..., lo:hi]

    def forward(self, i: int, lo: int, hi: int):
        """The forward of layer ``i`` in a ``use_packed`` block whose packed range is ``lo``
        to ``hi`` rows."""
        layer = self.layers[i]

        def forward(x: torch.Tensor) -> torch.Tensor:
            way = self.way(x, lo, hi)
            if way == "linear":
                return F.linear(x, layer.weight, layer.bias)
            return self.run(x, i, way)

        return forward

    def release(self) -> None:
        self._last = None


def sibling_groups(model: torch.nn.Module, forward, min_weight: int = MIN_PACKED_WEIGHT) -> list:
    """Groups of the float32 CPU linears of ``model`` that one call of ``forward()`` (a forward
    of the model) calls with the same input tensor, one after another: ``[Group, ...]`` in call
    order. Every traced layer is in one group (alone if it has no sibling)."""
    layers = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
        and m.weight.numel() >= min_weight
    ]
    calls: list = []
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, args: calls.append((mod, args[0] if args else None))
        )
        for m in layers
    ]
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in hooks:
            h.remove()
    groups, seen = [], set()
    for layer, x in calls:
        if layer in seen:
            continue
        seen.add(layer)
        last = groups[-1] if groups else None
        if (
            last is not None
            and x is not None
            and last[1] is x
            and layer.weight.shape[1] == last[0][0].weight.shape[1]
        ):
            last[0].append(layer)
        else:
            groups.append(([layer], x))
    return [Group(g) for g, _ in groups]


def plan_small_rows(groups: list, repeats: int = 3, max_bytes: int = 256 << 20) -> None:
    """Set each group's kernel at 1 and 2 rows to the fastest of :data:`KERNELS` on this CPU,
    timed over the groups of one shape in forward order (up to ``max_bytes`` of weights: a real
    forward reads them from memory, not from cache); measured once per layer set and thread
    count. Makes each group's weights: packed, and transposed only where ``fused`` won."""
    by_shape: dict = {}
    for g in groups:
        by_shape.setdefault(g.shape, []).append(g)
    for shape, same in by_shape.items():
        key = ("small_rows", shape, len(same), torch.get_num_threads())
        kernel = _derived(
            same[0].layers[0], key, lambda same=same: _time_kernels(same, repeats, max_bytes)
        )
        for g in same:
            g.kernel = dict(kernel)
            g.make(fused="fused" in kernel.values())


def _time_kernels(same: list, repeats: int, max_bytes: int) -> dict:
    """``{rows: kernel}`` for the groups ``same`` (one shape), each kernel timed over them."""
    timed, total = [], 0
    for g in same:
        if total >= max_bytes:
            break
        timed.append(g)
        total += sum(x.weight.numel() * 4 for x in g.layers)
        g.make(fused=True, keep=False)
    k = same[0].layers[0].weight.shape[1]
    ways = {"linear": None, "fused": "fused"} | (
        {"packed": "packed"} if timed[0].packed is not None else {}
    )

    def run(way):
        def call(n):
            for g in timed:  # a new input per group, as in a forward
                x = torch.randn(n, k)
                if way is None:
                    [F.linear(x, layer.weight, layer.bias) for layer in g.layers]
                else:
                    [g.run(x, i, way) for i in range(len(g.layers))]
                g.release()

        return call

    with torch.no_grad():
        kernel = _fastest({name: run(way) for name, way in ways.items()}, repeats)
    for g in timed:
        g.wt = g.packed = g.bias = None  # plan_small_rows makes the shared copies
    return kernel


def _fastest(ways: dict, repeats: int, clock=time.perf_counter) -> dict:
    """``ways``: ``{name: call(rows)}``; for each of :data:`SMALL_ROWS`, the name of the fastest
    (the least of ``repeats`` timings after one warm-up round, the ways interleaved)."""
    best: dict = {}
    for rep in range(repeats + 1):
        for n in SMALL_ROWS:
            for name, call in ways.items():
                t0 = clock()
                call(n)
                dt = clock() - t0
                if rep:
                    best[n, name] = min(best.get((n, name), dt), dt)
    return {n: min(ways, key=lambda name: best[n, name]) for n in SMALL_ROWS}


def traced_groups(base: torch.nn.Module) -> list:
    """The sibling linears of one traced 1-token forward of ``base`` (a transformers base
    model), planned by :func:`plan_small_rows`; ``[]`` if the trace fails (the model then keeps
    per-layer kernels)."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=base.device)
    try:
        groups = sibling_groups(base, lambda: base(input_ids=ids, use_cache=False))
    except Exception as e:  # noqa: BLE001 (a model the trace cannot run keeps its kernels)
        logger.info("CPU kernels: no sibling linears traced (%s: %s)", type(e).__name__, e)
        return []
    plan_small_rows(groups)
    return groups


def describe(groups: list) -> list[str]:
    """How many groups run each kernel at 1 and 2 tokens, e.g. ``1 token: linear 30 fused 90``."""
    parts = []
    for n in SMALL_ROWS if groups else ():
        ways = [g.kernel.get(n) for g in groups]
        parts.append(
            f"{n} token{'s' if n > 1 else ''}: "
            + " ".join(f"{k} {ways.count(k)}" for k in KERNELS if ways.count(k))
        )
    return parts
