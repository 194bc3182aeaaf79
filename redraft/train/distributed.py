"""Processes: one without a launcher, or the ranks of ``deepspeed`` / ``torchrun``.

:func:`setup_distributed` joins the launcher's process group (or makes a world of one) and
returns a :class:`DistEnv`, the only object the rest of the trainer asks about ranks.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

import torch

from redraft.utils import require_extra, resolve_device


@dataclass
class DistEnv:
    """This process's place in the world: ``rank`` of ``world_size``, and its ``device``."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        """Sum (or ``op``) of ``t`` over all ranks, in place; a no-op in a world of one."""
        if self.world_size > 1:
            torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
        return t

    def say(self, msg: str) -> None:
        """Print ``msg`` to stderr on rank 0 only."""
        if self.is_main:
            print(msg, file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_train_device(device: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without CUDA is a ConfigError naming
    ``--device`` (:func:`redraft.utils.resolve_device`), raised before any work."""
    from redraft.errors import ConfigError

    try:
        return resolve_device(None if device == "auto" else device)
    except ConfigError as exc:
        raise ConfigError(f"--device {device}: {exc}", param="device") from exc


def setup_distributed(cfg) -> DistEnv:
    """Join the launcher's process group, or make a world of one (no launcher needed).

    gloo on CPU, nccl on CUDA. On CPU the cores are split between the local ranks
    (``cfg.threads`` overrides).
    """
    use_cuda = resolve_train_device(cfg.device).type == "cuda"
    if "RANK" not in os.environ:  # plain `python -m redraft.train.cli` / `redraft-train`
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if not use_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    require_extra("train", "deepspeed", what="training (DeepSpeed)")
    import deepspeed

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(
            dist_backend="nccl" if use_cuda else "gloo", auto_mpi_discovery=False, verbose=False
        )
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world)))
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // max(1, local_world)))
    return DistEnv(rank, world, local_rank, device)
