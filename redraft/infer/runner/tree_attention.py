"""Attention of a verify forward on the CPU, one compiled loop per row (float32).

A verify forward attends row ``b``'s ``n`` new tokens over the row's ``lengths[b]`` cached
columns (all of them) and the new tokens' own columns (each token its tree ancestors and itself).
SDPA gets this as a dense additive mask over the longest row of each run of rows
(:func:`~redraft.infer.runner.grouped_attention.row_groups`) and pays a fixed cost per call,
large against a decoding step's few hundred columns. :func:`tree_attention` reads each row's own
columns only, once for all the query heads that share a key/value head and all the row's tree
tokens, and the tree part from the ancestor matrix; the mask is not read. Same arithmetic (scaled
dot products, a softmax with its maximum taken out, a weighted sum of values), summed in
another order and with a polynomial exponential: float32 outputs within a few units of the last
place of SDPA's.

The verifier turns it on for CPU float32 forwards of one token per row, and of a few tokens per
row at two rows or more (:func:`pays`; ``compiled_attention``); SDPA stays for everything else
(one row's trees, other dtypes and devices, prefill forwards).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import numpy as np
import torch

try:  # a dependency; without it the verifier keeps SDPA
    import numba
except Exception:  # pragma: no cover - not installed, or built for another numpy
    numba = None

# the current verify forward's rows (host): (lengths int64 [B], anc bool [B, n, n]), or None
_TREE: contextvars.ContextVar = contextvars.ContextVar("redraft_tree", default=None)


@contextlib.contextmanager
def with_tree(lengths: np.ndarray, anc: np.ndarray):
    """Forwards inside attend with :func:`tree_attention` (row ``b``: ``lengths[b]`` cached
    columns, then its ``n`` tree tokens with ancestors ``anc[b]``)."""
    token = _TREE.set((lengths, anc))
    try:
        yield
    finally:
        _TREE.reset(token)


# Cephes' expf: exp(x) = 2^k exp(r), |r| <= ln 2 / 2, exp(r) by a degree-6 polynomial; within
# about one unit of the last place of float32. A loop over it vectorises (no call per element),
# where math.exp is one scalar call per element: the softmax of a tree's rows was most of the
# loop's time with it.
_LOG2E = np.float32(1.44269504)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_P0, _P1, _P2 = (
    np.float32(1.9875691500e-4),
    np.float32(1.3981999507e-3),
    np.float32(8.3334519073e-3),
)
_P3, _P4, _P5 = (
    np.float32(4.1665795894e-2),
    np.float32(1.6666665459e-1),
    np.float32(5.0000001201e-1),
)
_LO, _HI = np.float32(-87.0), np.float32(88.0)  # exp(-87) ~ 1.6e-38: below it, 0
_HALF, _ONE, _ZERO = np.float32(0.5), np.float32(1.0), np.float32(0.0)


def _exp(x, bits):  # pragma: no cover - compiled
    """``x = exp(x)`` in place, 0 at or below ``-87`` (``-inf``: a masked column); ``bits``: an
    int32 scratch as long as ``x``."""
    m = x.shape[0]
    two_k = bits[:m].view(np.float32)
    for i in range(m):
        v = x[i]
        c = min(max(v, _LO), _HI)
        k = np.floor(c * _LOG2E + _HALF)
        r = c - k * _LN2_HI - k * _LN2_LO
        y = (((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5) * r * r + r + _ONE
        bits[i] = (np.int32(k) + np.int32(127)) << np.int32(23)  # 2^k's float32 bits
        x[i] = y if v > _LO else _ZERO
    for i in range(m):
        x[i] = x[i] * two_k[i]


if numba is not None:
    _exp = numba.njit(cache=True, nogil=True, fastmath=True, inline="always")(_exp)


def _score(q, k, b, h, r, t, scale, s, mx):  # pragma: no cover - compiled
    """``s[t, r]``: query row ``r``'s scaled dot product with key column ``t``; ``mx[r]`` its
    running maximum."""
    x = np.float32(0.0)
    for c in range(q.shape[3]):
        x += q[b, h, r, c] * k[b, h, t, c]
    x *= scale
    s[t, r] = x
    mx[r] = max(mx[r], x)


if numba is not None:
    _score = numba.njit(cache=True, nogil=True, fastmath=True, inline="always")(_score)


def _attend(q, k, v, lengths, anc, scale, out):  # pragma: no cover - compiled
    """``q [B, kv_heads, R, d]`` (``R = g n`` query rows of a key/value head, row ``j n + i``
    token ``i`` of query head ``j``), ``k``/``v [B, kv_heads, capacity, d]`` (the cache: row
    b's cached columns ``0 .. L-1``, its tree ``L .. L+n-1``), ``anc [B, n, n]``; writes
    ``out [B, kv_heads, R, d]``. Every key and value column is read once for the R rows."""
    B, KV, R, d = q.shape
    n = anc.shape[1]
    s = np.empty((k.shape[2], R), np.float32)  # [column, query row]
    mx = np.empty(R, np.float32)
    z = np.empty(R, np.float32)
    acc = np.empty((R, d), np.float32)
    bits = np.empty(k.shape[2] * R, np.int32)
    for b in range(B):
        L = lengths[b]
        for h in range(KV):
            mx[:] = -np.inf
            for t in range(L):  # the row's cache: every query row sees it
                for r in range(R):
                    _score(q, k, b, h, r, t, scale, s, mx)
            for t in range(L, L + n):  # the tree: ancestors and self
                for r in range(R):
                    if anc[b, r % n, t - L]:
                        _score(q, k, b, h, r, t, scale, s, mx)
                    else:
                        s[t, r] = -np.inf
            for t in range(L + n):
                for r in range(R):
                    s[t, r] -= mx[r]
            _exp(s.reshape(-1)[: (L + n) * R], bits)
            z[:] = 0.0
            for t in range(L + n):
                for r in range(R):
                    z[r] += s[t, r]
            acc[:] = 0.0
            for t in range(L + n):
                for r in range(R):
                    w = s[t, r]
                    for c in range(d):
                        acc[r, c] += w * v[b, h, t, c]
            for r in range(R):
                for c in range(d):
                    out[b, h, r, c] = acc[r, c] / z[r]


_attend_jit = (
    numba.njit(cache=True, nogil=True, fastmath=True)(_attend) if numba is not None else None
)


def available() -> bool:
    return _attend_jit is not None


# tokens per row up to which a batch of two rows or more attends through the loop. SDPA's
# costs that the loop does not pay grow with the rows (a call per run of rows, the masked
# columns of rows shorter than their run's longest); the loop's grow with the query rows (a
# horizontal sum per query row and column): on one row SDPA is faster from a few tokens, and a
# batch's tree is a few tokens a row (the budget's node limit). The loop was 1.4-2.4x SDPA at
# 2-16 rows and 2-4 tokens, and 0.8-1.5x at 8 tokens (decision record 0017).
MAX_BATCH_TOKENS = 4


def pays(rows: int, n: int) -> bool:
    """Whether a forward of ``rows`` rows and ``n`` tokens each attends through the loop: one
    token per row, or a few at two rows or more (:data:`MAX_BATCH_TOKENS`)."""
    return n == 1 or (rows >= 2 and n <= MAX_BATCH_TOKENS)


def supports(module, query, key, kwargs) -> bool:
    """Whether :func:`tree_attention` computes this call: float32 on the CPU, a plain scaled
    dot product (no bias, soft cap, sliding window or sinks) and the forward's rows set."""
    return (
        _attend_jit is not None
        and _TREE.get() is not None
        and query.device.type == "cpu"
        and query.dtype == torch.float32
        and key.dtype == torch.float32
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and kwargs.get("sliding_window") is None
        and getattr(module, "sinks", None) is None
        and not kwargs.get("dropout")
    )


def _whole(x: torch.Tensor) -> np.ndarray:
    """A cache view ``[B, kv_heads, span, d]`` (consecutive slots of a ``[slots, kv_heads,
    capacity, d]`` buffer) as the C-contiguous ``[B, kv_heads, capacity, d]`` array over the same
    memory, so the compiled loop reads whole rows with unit stride; a copy if it is no such
    view."""
    B, KV, _, d = x.shape
    st = x.stride()
    cap = st[1] // d if d else 0
    if st[3] == 1 and st[2] == d and st[0] == KV * st[1] and cap >= x.shape[2]:
        full = torch.as_strided(x, (B, KV, cap, d), st)
        return full.numpy()
    return x.contiguous().numpy()


def tree_attention(module, query, key, value, **kwargs) -> torch.Tensor:
    """``query [B, heads, n, d]`` over ``key``/``value [B, kv_heads, span, d]`` as the rows set
    by :func:`with_tree` say; returns ``[B, n, heads, d]`` (what ``sdpa`` returns)."""
    lengths, anc = _TREE.get()
    B, H, n, d = query.shape
    KV = key.shape[1]
    g = H // KV
    scale = kwargs.get("scaling")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q = query.contiguous().view(B, KV, g * n, d).numpy()
    out = torch.empty(B, KV, g * n, d, dtype=query.dtype)
    _attend_jit(q, _whole(key), _whole(value), lengths, anc, np.float32(scale), out.numpy())
    return out.view(B, H, n, d).transpose(1, 2).contiguous()
