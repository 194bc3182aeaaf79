"""Attention of a verify forward on the CPU, one compiled loop per row (float32).

A verify forward attends row ``b``'s ``n`` new tokens over the row's ``lengths[b]`` cached
columns (all of them) and the new tokens' own columns (each token its tree ancestors and itself).
SDPA gets this as a dense additive mask over the batch's longest row: it reads every masked
column of every shorter row, and one call per run of rows (:func:`~redraft.infer.runner.
grouped_attention.row_groups`) pays a fixed cost per call that is large against a decode step's
few hundred columns. :func:`tree_attention` reads each row's own columns only, once for the
query heads that share a key/value head, and the tree part from the ancestor matrix instead of a
mask; no mask is built. Same arithmetic (scaled dot products, softmax with its maximum taken
out, weighted sum of values), summed in another order: float32 outputs within a few units of the
last place of SDPA's.

The verifier turns it on for CPU float32 forwards (:func:`with_tree`, ``cpu_tree_attention``);
transformers' ``sdpa`` stays for everything else (other dtypes, devices, prefill forwards).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import numpy as np
import torch

from redraft.infer.spec.hostjit.njit import numba

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


def current():
    """The rows set by :func:`with_tree`, or None."""
    return _TREE.get()


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
    for b in range(B):
        L = lengths[b]
        for h in range(KV):
            mx[:] = -np.inf
            for t in range(L):  # the row's cache: every query row sees it
                for r in range(R):
                    x = np.float32(0.0)
                    for c in range(d):
                        x += q[b, h, r, c] * k[b, h, t, c]
                    x *= scale
                    s[t, r] = x
                    mx[r] = max(mx[r], x)
            for t in range(L, L + n):  # the tree: ancestors and self
                for r in range(R):
                    if anc[b, r % n, t - L]:
                        x = np.float32(0.0)
                        for c in range(d):
                            x += q[b, h, r, c] * k[b, h, t, c]
                        x *= scale
                        s[t, r] = x
                        mx[r] = max(mx[r], x)
                    else:
                        s[t, r] = -np.inf
            z[:] = 0.0
            for t in range(L + n):
                for r in range(R):
                    e = np.float32(math.exp(s[t, r] - mx[r]))
                    s[t, r] = e
                    z[r] += e
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
