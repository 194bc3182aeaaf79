"""A device function captured in a CUDA graph per input shape and replayed (drafting on CUDA).

A ReDrafter beam search is ~190 small kernels per step (5 head steps, top-k, gathers); launched
one by one from Python that is milliseconds of host time a step on a GPU,
more than the verify it feeds. Its shapes are fixed by ``(rows, width, length)`` and it reads
nothing back to the host, so one graph per shape replays it as a single launch. The verify's
own graphs (:class:`~redraft.infer.runner.verify.GraphSet`) are tied to a KV cache's buffer; these
depend only on the function's weights and their static input buffers.

:class:`GraphStore` holds the policy both follow: a shape is captured the second call in a row
it is used, or its :data:`CAPTURE_AFTER`-th use in all (a server's batch changes often, so a
shape used once never pays a capture; a speculating engine's tree sizes alternate from step to
step, so "in a row" alone left a third of a distillation run's steps eager), every
capture shares one memory pool, at most ``max_graphs`` graphs are kept (the least recently
replayed is dropped; once full, only a shape used twice in a row displaces one), and **a
capture that fails never changes the result**: it is logged once, the shape runs eagerly from
then on.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections import Counter
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

CAPTURE_AFTER = 3  # uses of a shape (in a row or not) after which it is captured


def graph_stats() -> dict:
    """Counters of how a captured function ran (``redraft-bench`` reports them)."""
    return {"captures": 0, "capture_s": 0.0, "failed": 0, "replays": 0, "eager": 0, "dropped": 0}


def cuda_capture(fn, device, pool):
    """Capture ``fn()`` (over static input buffers) in a CUDA graph: PyTorch's recipe, warm-up on
    a side stream then capture. Returns ``(graph, output)``."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with no_cyclic_gc(), torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


@contextlib.contextmanager
def no_cyclic_gc():
    """Python's cyclic garbage collector off for the duration (restored after).

    ``torch.cuda.graph`` no longer collects before a capture (``force_cudagraph_gc`` is off by
    default: too slow), so a collection that a capture's own allocations trigger can free the
    graphs of a dead decoder in mid-capture, and destroying a graph while a stream captures is
    not permitted: that capture fails. Seen on a GPU (eight
    "operation not permitted when stream is capturing (function reset)" warnings, then "operation
    failed due to a previous error during capture", in a test that makes a decoder per drafter).
    The garbage is collected after the capture instead."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def after_failed_capture(device, what: str, exc: Exception, warned: bool) -> None:
    """What follows a failed capture: the device synchronised (a capture's error can surface
    asynchronously) and, unless the caller ``warned`` already, one warning naming ``what``."""
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(device)
    if not warned:
        log.warning(
            "CUDA graph capture of %s failed (%s: %s); this shape runs eagerly from now on (the "
            "output is unchanged).",
            what,
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )


class GraphStore:
    """The graphs captured per shape key, their memory pool and the capture policy.

    :meth:`lookup` says, for a call of ``key``, the graph to replay or whether to capture one
    now; :meth:`add` keeps a new graph (dropping the least recently replayed past
    ``max_graphs``), :meth:`failed` marks a shape eager for good.
    """

    def __init__(self, max_graphs: int = 256):
        self.max_graphs = max(1, int(max_graphs))
        self.entries: dict = {}  # key -> entry, least recently used first
        self.eager: set = set()  # keys whose capture failed
        self.uses: Counter = Counter()  # calls of keys without a graph
        self.pool = None
        self.dropped = 0
        self._last_key = None

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, key) -> tuple[dict | None, bool]:
        """``(entry, capture)``: the graph of ``key`` if there is one (then the most recently
        used), else ``None`` and whether the policy captures it now."""
        repeat, self._last_key = key == self._last_key, key
        entry = self.entries.get(key)
        if entry is not None:
            self.entries[key] = self.entries.pop(key)
            return entry, False
        if key in self.eager:
            return None, False
        self.uses[key] += 1
        # full: only a shape used twice in a row displaces a graph (no churn from shapes that
        # merely recur, e.g. a server's many batch sizes x tree sizes x spans)
        full = len(self.entries) >= self.max_graphs
        return None, repeat or (self.uses[key] >= CAPTURE_AFTER and not full)

    def add(self, key, entry: dict) -> int:
        """Keep ``entry`` for ``key``; returns how many graphs were dropped to make room."""
        n = 0
        while len(self.entries) >= self.max_graphs:
            self.entries.pop(next(iter(self.entries)))
            n += 1
        self.entries[key] = entry
        self.uses.pop(key, None)
        self.dropped += n
        return n

    def failed(self, key) -> None:
        """``key``'s capture failed: it stays eager; the pool may be unusable, start a new one."""
        self.eager.add(key)
        self.pool = None

    def clear(self, forget_failures: bool = True) -> None:
        """Drop every graph and the pool with them (a later capture starts a new pool: reusing
        the handle of a pool whose graphs were all freed trips the CUDA caching allocator)."""
        self.entries.clear()
        self.uses.clear()
        self.pool, self._last_key = None, None
        if forget_failures:
            self.eager.clear()


class ShapeGraphs:
    """``fn(key, *inputs)`` (tensors in, a tensor out), captured per ``key`` and replayed.

    Args:
        fn: the function; ``key`` (hashable) fixes everything about its work except the values
            of ``inputs`` (their shapes included). It must not read device values back to the
            host (a capture refuses).
        device: where ``fn`` runs; graphs only on CUDA unless ``enabled`` says otherwise.
        capture: ``capture(fn, device, pool) -> (graph, out)`` (default
            :func:`cuda_capture`); tests inject their own.
        enabled: capture at all (default: ``device`` is CUDA).
        name: what the log calls it.
        max_graphs: graphs kept at most; the least recently replayed one is dropped for a new
            one (a server's batch sizes times an "auto" beam's widths and lengths are many
            shapes over its life; each graph holds its buffers in the pool).

    The returned tensor of a replay is the graph's output buffer: valid until the next call.
    """

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        device,
        capture=None,
        enabled: bool | None = None,
        name: str = "function",
        max_graphs: int = 256,
    ):
        self.fn, self.device, self.name = fn, torch.device(device), name
        self.enabled = self.device.type == "cuda" if enabled is None else enabled
        self.capture = capture or cuda_capture
        self.store = GraphStore(max_graphs)  # key -> {"graph", "inputs", "out"}
        self.stats = graph_stats()
        self._warned = False

    def __call__(self, key, *inputs: torch.Tensor) -> torch.Tensor:
        entry, capture = self.store.lookup(key)
        if capture and self.enabled:
            entry = self._capture(key, inputs)
        if entry is None:
            self.stats["eager"] += 1
            return self.fn(key, *inputs)
        for buf, x in zip(entry["inputs"], inputs, strict=True):
            buf.copy_(x)
        entry["graph"].replay()
        self.stats["replays"] += 1
        return entry["out"]

    def _capture(self, key, inputs) -> dict | None:
        static = [x.clone() for x in inputs]
        store = self.store
        t0 = time.perf_counter()
        try:
            if store.pool is None and self.device.type == "cuda":
                store.pool = torch.cuda.graph_pool_handle()
            graph, out = self.capture(lambda: self.fn(key, *static), self.device, store.pool)
        except Exception as exc:  # noqa: BLE001 - a failed capture must leave the result intact
            self.stats["failed"] += 1
            store.failed(key)
            after_failed_capture(self.device, f"the {self.name} of shape {key}", exc, self._warned)
            self._warned = True
            return None
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        entry = {"graph": graph, "inputs": static, "out": out}
        self.stats["dropped"] += store.add(key, entry)
        return entry

    @property
    def entries(self) -> dict:
        return self.store.entries

    @property
    def eager(self) -> set:
        return self.store.eager

    def clear(self) -> None:
        """Drop every graph and the pool (e.g. the function's weights moved)."""
        self.store.clear()
