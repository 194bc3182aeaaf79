"""Compiled (numba) kernels of the decode step's host work: the same results as the numpy code.

A speculative step's host work at one row is a few hundred numpy calls of a few elements each
(context matching, the tree, the walk, the statistics), each costing ~1-3 us of dispatch: on a
GPU that was more host time a step for N-Grammys than the verify of the default target
(docs/design/0003-host-kernels.md). Loops compiled by numba do the same work per row in microseconds, the way
vLLM's n-gram proposer does (numba, for the same reason). Each kernel here returns exactly what
its numpy counterpart returns (tests compare them on random inputs, ties included); the numpy
functions stay as the reference and as the fallback where numba is missing or turned off
(``REDRAFT_JIT=0``).

Building a speculative decoder compiles the kernels (``decoder.warm_host_kernels``: seconds
the first time on a machine, then loaded from numba's disk cache in a fraction of a second), so no decode
step compiles. They release the GIL (``nogil``), so a server's event loop keeps running while
the decode thread is in them.

The kernels, by concern: :mod:`~redraft.infer.spec.hostjit.tree` (the tree, the walk, the
feedback), :mod:`~redraft.infer.spec.hostjit.ngram` (context matching, N-Grammys),
:mod:`~redraft.infer.spec.hostjit.stats` (rates, node budget) and
:mod:`~redraft.infer.spec.hostjit.beams` (ReDrafter's beams), all compiled with
:mod:`~redraft.infer.spec.hostjit.njit`'s decorator. This package re-exports them; callers check
:data:`ENABLED` and call them from here.
"""

from __future__ import annotations

import os

from redraft.infer.spec.hostjit.beams import _beam_groups, _plan_beam, _rank_bucket
from redraft.infer.spec.hostjit.ngram import _ngram_rows, ngram_rows
from redraft.infer.spec.hostjit.njit import _IMPORT_ERROR, numba
from redraft.infer.spec.hostjit.stats import _best_budget, _stats_update, _stats_values
from redraft.infer.spec.hostjit.tree import (
    _feedback,
    _tree_fill,
    _tree_nodes,
    _walk,
    build_tree,
    feedback,
    owners,
    walk,
)

__all__ = [  # the status, and the kernels and wrappers the numpy code calls when ENABLED
    "ENABLED",
    "numba",
    "status",
    "build_tree",
    "feedback",
    "ngram_rows",
    "owners",
    "walk",
    "_beam_groups",
    "_best_budget",
    "_feedback",
    "_ngram_rows",
    "_plan_beam",
    "_rank_bucket",
    "_stats_update",
    "_stats_values",
    "_tree_fill",
    "_tree_nodes",
    "_walk",
]

ENABLED = numba is not None and os.environ.get("REDRAFT_JIT", "1") != "0"


def status() -> str:
    """Which host kernels run, in words (for benchmark tables and logs)."""
    if numba is None:
        return f"numpy (numba unavailable: {_IMPORT_ERROR})"
    if os.environ.get("REDRAFT_JIT", "1") == "0":
        return f"numpy (REDRAFT_JIT=0; numba {numba.__version__} installed)"
    return f"numba {numba.__version__}" if ENABLED else "numpy (compiled kernels turned off)"
