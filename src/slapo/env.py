"""``slapo.env.setup``: start a process group in one call, from a script, notebook or torchrun.

The group's coordinates are also exported as the launcher variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) where they are unset, so libraries that read
them (DeepSpeed requires ``LOCAL_RANK``) work in processes that torchrun did not start;
:func:`teardown` restores what was there before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .exceptions import SlapoError

__all__ = ["LAUNCHER_VARS", "DistEnv", "export_env", "setup", "teardown"]

# What torchrun sets in each process it starts.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# The values setup()/export_env() replaced (None: unset), which teardown() puts back.
_saved: dict[str, str | None] = {}


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
    The launcher variables torchrun would have set are exported where unset (:func:`export_env`).

    Example:
        >>> import slapo
        >>> env = slapo.env.setup()            # a one-process group, e.g. in a notebook
        >>> env.rank, env.world_size
        (0, 1)
    """
    if dist.is_initialized():
        export_env()
        return _current()
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if not 0 <= rank < world_size:
        raise SlapoError(f"slapo.env.setup: rank {rank} is not in [0, world_size={world_size})")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    _set_env("MASTER_ADDR", master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1"))
    _set_env("MASTER_PORT", str(master_port or os.environ.get("MASTER_PORT", 29500)))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    limit = timedelta(seconds=timeout)
    store = _attempt_store(rank, world_size, limit)
    if store is None:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=limit)
    else:
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=limit
        )  # fmt: skip
    export_env(local_rank)
    return DistEnv(rank, world_size, local_rank, backend)


def _attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store | None:
    """Under ``torchrun --max-restarts``, the rendezvous store of this attempt only.

    torchrun's static rendezvous keeps one store across restarts, so a restarted group would
    read the addresses the dead attempt published (gloo then connects to a closed port and
    fails). Keys under ``attempt<TORCHELASTIC_RESTART_COUNT>/`` are this attempt's own. None
    outside torchelastic: the plain ``env://`` rendezvous.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return None
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    return dist.PrefixStore(f"attempt{attempt}/", store)


def export_env(local_rank: int | None = None) -> dict[str, str]:
    """Set the launcher variables of the running process group where they are unset.

    ``RANK`` and ``WORLD_SIZE`` come from the group; ``LOCAL_RANK`` from ``local_rank``, else the
    current CUDA device under NCCL, else the rank (one node). ``MASTER_ADDR``/``MASTER_PORT`` are
    those :func:`setup` used, if it started the group. A value already set (by torchrun or the
    user) is never changed. Returns the five variables as they stand (those known).

    Example:
        >>> import slapo
        >>> env = slapo.env.setup(rank=0, world_size=1)
        >>> slapo.env.export_env()["LOCAL_RANK"]
        '0'
    """
    if not dist.is_available() or not dist.is_initialized():
        raise SlapoError(
            "slapo.env.export_env needs a running process group: call slapo.env.setup() first"
        )
    rank = dist.get_rank()
    if local_rank is None:
        cuda = dist.get_backend() == "nccl" and torch.cuda.is_available()
        local_rank = torch.cuda.current_device() if cuda else rank
    known = {"RANK": rank, "WORLD_SIZE": dist.get_world_size(), "LOCAL_RANK": local_rank}
    for key, value in known.items():
        if key not in os.environ:
            _set_env(key, str(value))
    return {k: os.environ[k] for k in LAUNCHER_VARS if k in os.environ}


def teardown() -> None:
    """Destroy the default process group if one is running; put back the launcher variables
    that :func:`setup` set (unset again where they were unset)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in _saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _saved.clear()


def _set_env(key: str, value: str) -> None:
    """``os.environ[key] = value``, remembering the first value replaced for teardown()."""
    _saved.setdefault(key, os.environ.get(key))
    os.environ[key] = value


def _current() -> DistEnv:
    rank = dist.get_rank()
    return DistEnv(
        rank, dist.get_world_size(), int(os.environ.get("LOCAL_RANK", rank)), dist.get_backend()
    )
