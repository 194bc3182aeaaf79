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

Sibling layers (called with one input: a layer's q/k/v projections, an MLP's gate and up
projections) run as one product over their weights side by side (``redraft.models.siblings``):
packed from 3 rows, and at 1-2 rows whichever of three kernels is measured fastest on this CPU.

Cost: one extra copy of every packed weight (float32 only), and of the sibling weights where
the transposed product wins at 1-2 rows. The outputs differ from the
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
    """``x @ W.T + b`` with a weight from :func:`pack_weight` (any leading shape of ``x``); a
    product of a few rows runs padded with zero rows where :func:`plan_row_padding` measured
    more rows faster on this CPU (each real row's output is its own dot products either way)."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    to = _ROW_PAD.get(torch.get_num_threads(), {}).get(m) if m < _PAD_TOP else None
    if to:
        flat = torch.cat([flat, flat.new_zeros(to - m, flat.shape[1])])
    out = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), packed, bias, "none", [], "")
    if to:
        out = out[:m]
    return out.reshape(*lead, out.shape[-1])


# Row padding of packed products, measured per thread count: {threads: {rows: padded rows}}.
# oneDNN's packed kernel does not cost more with every row: on an AVX-512 CPU without AMX the
# default target's linears took longer at 2 rows than at 4 (a verify forward of 2 tokens cost
# more than one of 4: docs/infer.md), so a product of ``rows`` runs as one of the cheapest
# measured row count at or above it, the extra rows zeros.
_ROW_PAD: dict[int, dict[int, int]] = {}
PAD_ROWS = range(2, 9)  # row counts measured (and padded to); 1 row keeps its measured kernel
_PAD_TOP = PAD_ROWS.stop
PAD_MARGIN = 0.9  # pad only where the padded product measured at least 10% faster


def plan_row_padding(model: torch.nn.Module, max_bytes: int = 96 << 20, repeats: int = 3) -> dict:
    """Measure oneDNN's packed products at :data:`PAD_ROWS` rows over ``model``'s float32
    linears (temporary packed copies of its first layers, up to ``max_bytes``: a forward reads
    its weights from memory) and set the padding :func:`packed_linear` uses at this thread count:
    ``rows -> the cheapest row count at or above it`` where that is :data:`PAD_MARGIN` faster.
    Once per process and thread count; returns the table."""
    threads = torch.get_num_threads()
    if threads in _ROW_PAD or not packing_available():
        return _ROW_PAD.get(threads, {})
    packs, total = [], 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not isinstance(m, torch.nn.Linear) or w.device.type != "cpu" or total >= max_bytes:
            continue
        if w.dtype == torch.float32 and w.numel() >= MIN_PACKED_WEIGHT:
            packs.append((w.shape[1], pack_weight(w), m.bias))
            total += w.numel() * 4
    if not packs:
        return {}
    table = _ROW_PAD[threads] = padding_table(_fastest_rows(packs, repeats))
    logger.info("CPU kernels: packed products padded %s", table or "nowhere")
    return table


def padding_table(seconds: dict) -> dict:
    """``{rows: seconds}`` of packed products -> ``{rows: padded rows}``: each row count runs as
    the cheapest at or above it, where that is :data:`PAD_MARGIN` faster than itself."""
    table = {}
    for m in sorted(seconds):
        to = min((n for n in sorted(seconds) if n >= m), key=lambda n: seconds[n])
        if to != m and seconds[to] < PAD_MARGIN * seconds[m]:
            table[m] = to
    return table


def row_padding() -> dict:
    """The row padding :func:`packed_linear` uses at this thread count (``{}``: none)."""
    return dict(_ROW_PAD.get(torch.get_num_threads(), {}))


def _fastest_rows(packs: list, repeats: int, clock=time.perf_counter) -> dict:
    """``{rows: seconds}``: the packed products ``packs`` run in order at each of
    :data:`PAD_ROWS` rows, the least of ``repeats`` timings after one warm-up round."""
    best: dict = {}
    with torch.no_grad():
        for rep in range(repeats + 1):
            for m in PAD_ROWS:
                xs = {k: torch.randn(m, k) for k, _, _ in packs}
                t0 = clock()
                for k, packed, bias in packs:
                    torch.ops.mkldnn._linear_pointwise(xs[k], packed, bias, "none", [], "")
                dt = clock() - t0
                if rep:
                    best[m] = min(best.get(m, dt), dt)
    return best


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
    model: torch.nn.Module,
    batch_hint: int = 8,
    min_weight: int = MIN_PACKED_WEIGHT,
    exclude: set = frozenset(),
) -> dict:
    """Packed weights for every float32 CPU ``nn.Linear`` of ``model`` with at least
    ``min_weight`` weights, except those in ``exclude``: ``{layer: packed}``.

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
        and m not in exclude
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
    ``groups`` (:class:`redraft.models.siblings.Group`) run with their group's kernels; on exit
    they are exactly as before. Not thread-safe for two
    users of one model at the same time."""
    forwards = {layer: _packed_forward(layer, packed, *rows) for layer, packed in packs.items()}
    for g in groups:
        forwards.update({layer: g.forward(i, *rows) for i, layer in enumerate(g.layers)})
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
