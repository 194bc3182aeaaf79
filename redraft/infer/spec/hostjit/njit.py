"""numba, where it imports, and the one decorator every host kernel is compiled with."""

from __future__ import annotations

_IMPORT_ERROR = ""  # why numba did not import, when it did not
try:  # numba is a dependency; without it (or with REDRAFT_JIT=0) the numpy code runs
    import numba
except Exception as exc:  # pragma: no cover - not installed, or built for another numpy
    numba, _IMPORT_ERROR = None, f"{type(exc).__name__}: {exc}"


def _njit(fn):
    if numba is None:  # pragma: no cover
        return fn
    return numba.njit(cache=True, nogil=True)(fn)
