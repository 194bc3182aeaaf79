"""Tensor ops a decode step dispatches outside the target's forward: the kernels a GPU launches.

On a GPU each dispatched op is (at least) one kernel launch and a few microseconds of host time,
so the number of ops a step runs besides the target forward is what bounds its host overhead,
and it can be counted on any machine::

    with OpCounter() as ops:
        engine.step()
    ops.total, ops.by_name.most_common(5)

Counted: every ATen op that reaches the dispatcher inside the ``with`` block (a
``TorchDispatchMode``), except

* view ops (``aten.view``, ``select``, ``slice``, ``expand``, ... : no kernel, no data);
* ops inside :func:`not_counted` blocks, which the verifier puts around the target's forward
  (its kernels are the model's, captured in one CUDA graph on a GPU).

Reads from the device to the host are counted separately in ``host_reads`` (``.item()``,
``.tolist()``, ``.cpu()`` of a device tensor on CUDA; on CPU, where those are free, by the
engine's :meth:`~redraft.infer.engine.engine.Engine.step` contract: one read per step).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_paused = 0  # depth of not_counted() blocks (one thread decodes; the server's decode thread)


@contextlib.contextmanager
def not_counted():
    """Ops inside this block are not counted by an active :class:`OpCounter`."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


def _is_view(func) -> bool:
    return bool(getattr(func, "is_view", False)) or func in _METADATA_OPS


# ops that touch no data and launch no kernel (shape/metadata queries and aliasing)
_METADATA_OPS = {
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.is_same_size.default,
}


class OpCounter(TorchDispatchMode):
    """Count dispatched ATen ops (see the module doc). ``total``, ``by_name`` (``Counter`` of
    ``aten.<op>`` names), ``host_reads``."""

    def __init__(self):
        super().__init__()
        self.by_name: Counter = Counter()
        self.host_reads = 0

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _paused and not _is_view(func):
            name = func.overloadpacket.__name__
            self.by_name[name] += 1
            if name == "_local_scalar_dense" or (
                name in ("_to_copy", "to", "copy_") and _device_to_host(func, args, kwargs)
            ):
                self.host_reads += 1
        return func(*args, **kwargs)


def _device_to_host(func, args, kwargs) -> bool:
    src = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if src is None or src.device.type == "cpu":
        return False
    if func.overloadpacket.__name__ == "copy_":  # dst.copy_(src)
        return (
            args[0].device.type == "cpu"
            and isinstance(args[1], torch.Tensor)
            and args[1].device.type != "cpu"
        )
    dev = kwargs.get("device")
    return dev is not None and torch.device(dev).type == "cpu"


def count_step_ops(engine, steps: int = 1) -> OpCounter:
    """Run ``steps`` engine steps under an :class:`OpCounter`; returns it (ops of all the steps)."""
    with OpCounter() as ops:
        for _ in range(steps):
            engine.step()
    return ops
