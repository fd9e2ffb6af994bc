"""This process's rank and the world size, globally or within a process group.

Without an initialized ``torch.distributed`` the process is rank 0 of 1, so single-process code
needs no branch. A group is None (the world), a ``ProcessGroup`` or a one-dimensional
``DeviceMesh``. This module imports nothing from slapo but its exceptions, so the logger and the
schedule may use it.

Example:
    >>> from slapo.ranks import get_rank, get_world_size
    >>> get_rank(), get_world_size()  # no process group started
    (0, 1)
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .exceptions import SlapoError

__all__ = ["get_rank", "get_world_size", "is_initialized"]


def is_initialized() -> bool:
    """Whether ``torch.distributed`` is available and a process group has been started."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the world if None); 0 without torch.distributed.

    A process outside ``group`` gets -1, as ``torch.distributed.get_rank`` says.

    Example:
        >>> get_rank()
        0
    """
    if not is_initialized():
        return 0
    return dist.get_rank(_process_group(group))


def get_world_size(group: Any = None) -> int:
    """The number of processes in ``group`` (the world if None); 1 without torch.distributed.

    Example:
        >>> get_world_size()
        1
    """
    if not is_initialized():
        return 1
    return dist.get_world_size(_process_group(group))


def _process_group(group: Any) -> Any:
    # A DeviceMesh stands for the group of its one dimension; anything else is torch's to judge.
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(group, DeviceMesh):
        return group
    if group.ndim != 1:
        names = group.mesh_dim_names
        hint = f"e.g. mesh[{names[-1]!r}]" if names else "a 1-D DeviceMesh"
        raise SlapoError(
            f"a {group.ndim}-D DeviceMesh has no single rank and size; pass one dimension, {hint}"
        )
    return group.get_group()
