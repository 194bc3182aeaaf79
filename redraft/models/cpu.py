"""Faster float32 linear layers on CPU for multi-token forwards (tree verification).

Why: a verify forward runs every linear layer on ``n`` tokens at once. With float32 weights
that do not fit in cache, PyTorch's default CPU GEMM is poor at small ``n``: on a small
AMX CPU one 576x1536 layer costs 0.28 ms for 1 token but 0.65 ms for 8 (a
memory-bound read turns into a badly blocked compute). oneDNN's prepacked weight layout
(``torch.ops.mkldnn._reorder_linear_weight``, what TorchInductor's CPU freezing pass uses)
brings 8 tokens down to 0.41 ms, while it is slower for 1 token (0.34 ms). On an AMD CPU
(avx512, no AMX) it is the other way round at 1-2 tokens: the default 2-row GEMM costs about
twice the 1-row one, and the packed kernel wins from 1 token. So :func:`pack_linears` makes a
packed copy of each weight, :func:`packed_from` / :func:`head_packed_from` measure from how
many tokens it is faster on this CPU (1, 2 or 3), and :func:`use_packed` puts it in use for
those forwards (plain decoding and the baseline included: one code path for both). The model
itself is never modified outside that block.

At 1-2 rows a third way often wins: the weights of *sibling* layers (those called with one
input, e.g. a layer's q/k/v projections, or an MLP's gate and up projections) side by side,
transposed and contiguous, so one ``x @ W.T`` streams them all (one call, and the row-vector
product reads the weight in memory order; on an AVX-512 CPU without AMX a 1-row forward of the
default target ran ~1.2x faster). :func:`sibling_groups` finds the siblings by tracing one
forward, and :func:`plan_small_rows` measures per group shape which of the three ways is fastest
at 1 and at 2 rows on this CPU; the fused copy is kept only where it wins.

Cost: one extra copy of every packed weight (float32 only), and of the sibling weights where
the fused way is used. The outputs differ from the
unpacked kernel by float32 rounding (about 1e-5 relative), the same order as the difference
between PyTorch's own 1-row and n-row kernels, so greedy outputs stay equal in practice; the
decoder's exactness tests run with packing on.

bfloat16 is left alone: with AMX units the default kernel is already nearly flat in ``n``.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_ATTR = "_redraft_packed"
# forwards of MIN..MAX rows use the packed weight by default: on some CPUs the default
# (memory-bound) kernel is still faster at 1-2 rows. At prefill sizes (hundreds to thousands of
# tokens, a flattened prefill forward of several prompts) the packed kernel is as fast on an AMX
# CPU and faster on an AVX-512 CPU without AMX. Which kernel is faster at 1 and 2 rows depends
# on the CPU: the verifier measures it (packed_from, head_packed_from below)
MIN_PACKED_ROWS, MAX_PACKED_ROWS = 3, 8192
# weights smaller than this stay in cache, where the default kernel is fine and oneDNN's fixed
# cost per call dominates (a hidden-32 test model ran its forward several times slower packed)
MIN_PACKED_WEIGHT = 1 << 16


def packing_available() -> bool:
    """True when this torch build has oneDNN's prepacked linear ops."""
    return bool(
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor, batch_hint: int = 8) -> torch.Tensor:
    """oneDNN-packed copy of a float32 ``[out, in]`` weight for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` with a weight from :func:`pack_weight` (any leading shape of ``x``)."""
    lead = x.shape[:-1]
    out = torch.ops.mkldnn._linear_pointwise(
        x.reshape(-1, x.shape[-1]).contiguous(), packed, bias, "none", [], ""
    )
    return out.reshape(*lead, out.shape[-1])


# derived weights per layer, made once and shared by every decoder over the same model; an
# entry is remade when the weight changes (another tensor, or an in-place update: ``_version``)
_DERIVED: weakref.WeakKeyDictionary[torch.nn.Module, dict] = weakref.WeakKeyDictionary()


def _derived(layer: torch.nn.Module, kind, make) -> torch.Tensor:
    w = layer.weight
    stamp = (w.data_ptr(), w._version)
    cache = _DERIVED.setdefault(layer, {})
    hit = cache.get(kind)
    if hit is None or hit[0] != stamp:
        hit = cache[kind] = (stamp, make())
    return hit[1]


def pack_linears(
    model: torch.nn.Module, batch_hint: int = 8, min_weight: int = MIN_PACKED_WEIGHT
) -> dict:
    """Packed weights for every float32 CPU ``nn.Linear`` of ``model`` with at least
    ``min_weight`` weights: ``{layer: packed}``.

    The model is not modified; :func:`use_packed` makes its forwards use the packs. Packs are
    made once per layer and shared. Empty when oneDNN is missing from this torch build or no
    layer is float32 on CPU.
    """
    if not packing_available():
        logger.info(
            "oneDNN packed linears are not available in this torch build; using the default kernels"
        )
        return {}
    return {
        m: _derived(m, ("packed", batch_hint), lambda m=m: pack_weight(m.weight, batch_hint))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
        and m.weight.numel() >= min_weight
    }


def head_weights(
    head: torch.nn.Module, dtype: torch.dtype, min_weight: int = MIN_PACKED_WEIGHT
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head for CPU verification: ``(W.T contiguous [in, out] in dtype, packed or None)``.

    ``x @ W.T`` with ``W.T`` stored contiguously is faster than ``F.linear(x, W)`` for the
    default target's 49152 x 576 bfloat16 head (the head never fits in cache): 6% at 1 row,
    23-39% at 2-16 rows (6.0 ms instead of 9.9 ms at 8);
    for float32 the packed copy serves 3 rows and more (11.5 ms instead of 30 ms at 8 rows).
    """
    wt = _derived(head, ("t", dtype), lambda: head.weight.detach().to(dtype).T.contiguous())
    packed = None
    if dtype == torch.float32 and packing_available() and head.weight.numel() >= min_weight:
        packed = _derived(head, ("packed-head", dtype), lambda: pack_weight(wt.T))
    return wt, packed


def packed_from(packs: dict, max_bytes: int = 256 << 20, repeats: int = 3) -> int:
    """The fewest rows from which the packed weights of ``packs`` run faster than the default
    kernels on this CPU: 1, 2, or :data:`MIN_PACKED_ROWS` when packing loses at 2 rows.

    Why measured: on some CPUs the default kernel wins at 1-2 rows (the module doc); on an
    AVX-512 CPU without AMX its 2-row GEMM costs about twice its 1-row one while the packed
    kernel costs about the same for 1 to 4 rows, which made a 2-token verify forward cost 1.6x
    a plain step (docs/infer.md, "CPU kernels"). Timed over the layers of ``packs`` in order,
    up to ``max_bytes`` of weights (a real forward reads its weights from memory, not from
    cache); made once per layer set and thread count (~0.5 s for the default target)."""
    if not packs:
        return MIN_PACKED_ROWS
    calls, total = [], 0
    for layer, packed in packs.items():
        if total >= max_bytes:
            break
        w, b = layer.weight, layer.bias
        calls.append(
            (
                w.shape[1],
                lambda x, w=w, b=b: F.linear(x, w, b),
                lambda x, p=packed, b=b: packed_linear(x, p, b),
            )
        )
        total += w.numel() * w.element_size()
    key = ("packed_from", torch.get_num_threads(), len(calls))
    return _derived(next(iter(packs)), key, lambda: _fastest_from(calls, repeats))


def head_packed_from(head: torch.nn.Module, wt: torch.Tensor, packed, repeats: int = 3) -> int:
    """As :func:`packed_from`, for the LM head of :func:`head_weights` (``x @ wt`` or the
    packed copy)."""
    if packed is None:
        return MIN_PACKED_ROWS
    calls = [(wt.shape[0], lambda x: x @ wt, lambda x: packed_linear(x, packed, None))]
    key = ("head_packed_from", wt.dtype, torch.get_num_threads())
    return _derived(head, key, lambda: _fastest_from(calls, repeats))


def _fastest_from(calls: list, repeats: int, clock=time.perf_counter) -> int:
    """``calls``: ``(in_features, default(x), packed(x))`` run in order, as a forward would;
    on 1 and 2 rows, both ways, the fastest of ``repeats`` after one warm-up round."""
    best = {}
    with torch.no_grad():
        for rep in range(repeats + 1):
            for n in (1, 2):
                xs = {k: torch.randn(n, k) for k, _, _ in calls}
                for packed_too in (False, True):
                    t0 = clock()
                    for k, default, packed in calls:
                        (packed if packed_too else default)(xs[k])
                    dt = clock() - t0
                    if rep:
                        best[n, packed_too] = min(best.get((n, packed_too), dt), dt)
    if best[2, True] >= best[2, False]:
        return MIN_PACKED_ROWS
    return 1 if best[1, True] < best[1, False] else 2


SMALL_ROWS = (1, 2)  # forwards of these many rows get the kernel measured per group shape
KERNELS = ("linear", "packed", "fused")


class Group:
    """Sibling float32 linears (called with one input, in this order) and how they run at 1
    and 2 rows: ``kernel[rows]`` is ``linear`` (``F.linear`` per layer), ``packed`` (the
    packed weight per layer) or ``fused`` (one ``x @ wt`` over the siblings' weights side by
    side, ``wt`` ``[in, sum of outs]`` contiguous; each layer returns its columns)."""

    def __init__(self, layers: list):
        self.layers = layers
        outs = [layer.weight.shape[0] for layer in layers]
        ends = [sum(outs[: i + 1]) for i in range(len(outs))]
        self.bounds = list(zip([0, *ends[:-1]], ends))
        self.kernel: dict[int, str] = {}
        self.wt: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        # (input, fused output) of the current forward: the siblings that follow take their
        # columns; cleared when the forward's use_packed block ends
        self._last = None

    @property
    def shape(self) -> tuple:
        return tuple((tuple(x.weight.shape), x.bias is not None) for x in self.layers)

    def make_fused(self, keep: bool = True) -> None:
        """The fused weight: a copy, with ``keep`` shared by every plan over these layers and
        made again when one of their weights changes; without, this group's alone (timing)."""

        def make():
            return torch.cat([x.weight.detach() for x in self.layers]).T.contiguous()

        stamp = tuple((x.weight.data_ptr(), x.weight._version) for x in self.layers)
        self.wt = _derived(self.layers[0], ("fused", stamp), make) if keep else make()
        if any(x.bias is not None for x in self.layers):
            self.bias = torch.cat(
                [
                    x.bias.detach() if x.bias is not None else x.weight.new_zeros(x.weight.shape[0])
                    for x in self.layers
                ]
            )

    def fused(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Layer ``i``'s output, from one product for all siblings per input."""
        last = self._last
        if last is None or last[0] is not x:
            y = (
                x @ self.wt
                if self.bias is None
                else torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.wt).reshape(
                    *x.shape[:-1], -1
                )
            )
            last = self._last = (x, y)
        lo, hi = self.bounds[i]
        return last[1][..., lo:hi]

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
            and last[1] is x
            and x is not None
            and layer.weight.shape[1] == last[0][0].weight.shape[1]
        ):
            last[0].append(layer)
        else:
            groups.append(([layer], x))
    return [Group(g) for g, _ in groups]


def plan_small_rows(groups: list, packs: dict, repeats: int = 3, max_bytes: int = 256 << 20):
    """Set each group's kernel at 1 and 2 rows to the fastest of :data:`KERNELS` on this CPU,
    timed over the groups of one shape in forward order (up to ``max_bytes`` of weights: a real
    forward reads them from memory, not from cache); made once per layer set and thread count.
    The fused weights are kept only where the fused kernel won."""
    by_shape: dict = {}
    for g in groups:
        by_shape.setdefault(g.shape, []).append(g)
    for shape, same in by_shape.items():
        key = ("small_rows", shape, len(same), torch.get_num_threads())
        kernel = _derived(
            same[0].layers[0], key, lambda same=same: _time_kernels(same, packs, repeats, max_bytes)
        )
        for g in same:
            g.kernel = dict(kernel)
            if "fused" in kernel.values():
                g.make_fused()
            else:
                g.wt = g.bias = None


def _time_kernels(same: list, packs: dict, repeats: int, max_bytes: int) -> dict:
    """``{rows: kernel}`` for the groups ``same`` (one shape), each way timed over them."""
    timed, total = [], 0
    for g in same:
        if total >= max_bytes:
            break
        timed.append(g)
        total += sum(x.weight.numel() * 4 for x in g.layers)
        g.make_fused(keep=False)
    k = same[0].layers[0].weight.shape[1]
    ways = {
        "linear": lambda g, x: [F.linear(x, layer.weight, layer.bias) for layer in g.layers],
        "fused": lambda g, x: [g.fused(x, i) for i in range(len(g.layers))],
    }
    if all(layer in packs for g in timed for layer in g.layers):
        ways["packed"] = lambda g, x: [
            packed_linear(x, packs[layer], layer.bias) for layer in g.layers
        ]

    def run(way):
        def call(n):
            for g in timed:  # a new input per group, as in a forward
                way(g, torch.randn(n, k))
                g.release()

        return call

    with torch.no_grad():
        kernel = _fastest({name: run(way) for name, way in ways.items()}, repeats)
    for g in timed:
        g.wt = g.bias = None  # plan_small_rows makes the shared copy where fused won
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


def small_row_kernels(base: torch.nn.Module, packs: dict) -> list:
    """The sibling linears of one traced 1-token forward of ``base`` (a transformers base
    model), each group's kernel at 1 and 2 tokens measured on this CPU; ``[]`` if the trace
    fails (the model then keeps the default kernels at 1-2 tokens)."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=base.device)
    try:
        groups = sibling_groups(base, lambda: base(input_ids=ids, use_cache=False))
    except Exception as e:  # noqa: BLE001 (a model the trace cannot run keeps its kernels)
        logger.info("CPU kernels: no sibling linears traced (%s: %s)", type(e).__name__, e)
        return []
    plan_small_rows(groups, packs)
    return groups


def describe(groups: list) -> list[str]:
    """How many groups run each kernel at 1 and at 2 tokens, e.g. ``1 token: linear 60 fused 60``."""
    parts = []
    for n in SMALL_ROWS if groups else ():
        ways = [g.kernel.get(n) for g in groups]
        parts.append(
            f"{n} token{'s' if n > 1 else ''}: "
            + " ".join(f"{k} {ways.count(k)}" for k in KERNELS if ways.count(k))
        )
    return parts


def _group_forward(g: Group, i: int, packed, lo: int, hi: int):
    layer = g.layers[i]

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.requires_grad:
            return F.linear(x, layer.weight, layer.bias)
        rows = x.numel() // max(x.shape[-1], 1)
        way = g.kernel.get(rows)
        if way is None:
            way = "packed" if lo <= rows <= hi else "linear"
        if way == "fused" and g.wt is not None:
            return g.fused(x, i)
        if way == "packed" and packed is not None:
            return packed_linear(x, packed, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    return forward


def _packed_forward(layer: torch.nn.Linear, packed: torch.Tensor, lo: int, hi: int):
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if lo <= rows <= hi and x.dtype == torch.float32 and not x.requires_grad:
            return packed_linear(x, packed, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    return forward


@contextlib.contextmanager
def use_packed(
    packs: dict, rows: tuple[int, int] = (MIN_PACKED_ROWS, MAX_PACKED_ROWS), groups: list = ()
):
    """Within the block, the layers of ``packs`` (from :func:`pack_linears`) run inputs of
    ``rows[0]`` to ``rows[1]`` rows (tokens) with their packed weights, and the layers of
    ``groups`` (from :func:`sibling_groups`, planned by :func:`plan_small_rows`) run 1 and 2
    rows with their group's kernel; on exit they are exactly as before. Not thread-safe for two
    users of one model at the same time."""
    forwards = {layer: _packed_forward(layer, packed, *rows) for layer, packed in packs.items()}
    for g in groups:
        for i, layer in enumerate(g.layers):
            forwards[layer] = _group_forward(g, i, packs.get(layer), *rows)
    saved = {
        layer: layer.__dict__.get("forward") for layer in forwards
    }  # instance-level forwards (hooks)
    for layer, forward in forwards.items():
        layer.forward = forward
    try:
        yield
    finally:
        for g in groups:
            g.release()
        for layer, old in saved.items():
            if old is None:
                del layer.forward  # back to the class's forward
            else:
                layer.forward = old
