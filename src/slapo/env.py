"""``slapo.env.setup``: start a process group in one call, from a script, notebook or torchrun."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .exceptions import SlapoError

__all__ = ["DistEnv", "setup", "teardown"]


@dataclass(frozen=True)
class DistEnv:
    """What :func:`setup` started: this process's rank, the world size and the backend."""

    rank: int
    world_size: int
    local_rank: int
    backend: str


def setup(
    rank: int | None = None,
    world_size: int | None = None,
    backend: str | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout: float = 300.0,
) -> DistEnv:
    """Initialize ``torch.distributed`` (once) and return this process's :class:`DistEnv`.

    Anything not given is read from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); without it, a single process (rank 0 of 1)
    on 127.0.0.1. The backend defaults to ``nccl`` with CUDA and ``gloo`` without; with NCCL the
    process's CUDA device is set to its local rank. ``timeout`` (seconds) bounds every collective,
    so a dead peer makes the others fail instead of hang. A second call returns the running group.

    Example:
        >>> env = slapo.env.setup()            # a one-process group, e.g. in a notebook
        >>> env.rank, env.world_size
        (0, 1)
    """
    if dist.is_initialized():
        return _current()
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if not 0 <= rank < world_size:
        raise SlapoError(f"slapo.env.setup: rank {rank} is not in [0, world_size={world_size})")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    os.environ["MASTER_ADDR"] = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(master_port or os.environ.get("MASTER_PORT", 29500))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
    )
    return DistEnv(rank, world_size, local_rank, backend)


def teardown() -> None:
    """Destroy the default process group if one is running."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _current() -> DistEnv:
    rank = dist.get_rank()
    return DistEnv(
        rank, dist.get_world_size(), int(os.environ.get("LOCAL_RANK", rank)), dist.get_backend()
    )
