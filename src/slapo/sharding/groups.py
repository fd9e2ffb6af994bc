"""Resolve what a schedule's ``group`` names (None, a ProcessGroup, a 1-D DeviceMesh) to a group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..exceptions import SlapoError

__all__ = ["resolve_group", "group_size", "group_rank", "same_group", "describe_group"]


def resolve_group(group: Any, where: str = "") -> dist.ProcessGroup | None:
    """The ``ProcessGroup`` that ``group`` names; None stands for the default (world) group.

    ``group`` may be None, a ``ProcessGroup``, or a one-dimensional ``DeviceMesh`` such as
    ``mesh["tp"]`` of a 2-D ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``.

    Example:
        >>> resolve_group(None) is None
        True
    """
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise SlapoError(
            f"{_at(where)}this process (global rank {dist.get_rank()}) is not a member of the "
            "group; each rank must schedule with a group it belongs to"
        )
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            names = group.mesh_dim_names or ()
            raise SlapoError(
                f"{_at(where)}a {group.ndim}-D DeviceMesh {tuple(group.mesh.shape)} was given as the "
                f"tensor-parallel group; pass one dimension of it, e.g. mesh[{names[-1]!r}]"
                if names
                else f"{_at(where)}pass a 1-D DeviceMesh (one mesh dimension) as the group"
            )
        return group.get_group()
    raise SlapoError(
        f"{_at(where)}group must be None, a torch.distributed ProcessGroup or a 1-D DeviceMesh, "
        f"got {type(group).__name__}"
    )


def require_initialized(where: str = "") -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise SlapoError(
            f"{_at(where)}tensor parallelism needs torch.distributed to be initialized; call "
            "slapo.env.setup(rank, world_size) (or run under torchrun) before scheduling"
        )


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None, where: str = "") -> int:
    rank = dist.get_rank(group)
    if rank < 0:
        raise SlapoError(
            f"{_at(where)}this process (global rank {dist.get_rank()}) is not a member of the "
            f"group {describe_group(group)}; each rank must schedule with a group it belongs to"
        )
    return rank


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def same_group(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    """Whether two groups hold the same global ranks, in the same order."""
    return a is b or group_ranks(a) == group_ranks(b)


def describe_group(group: dist.ProcessGroup | None) -> str:
    try:
        return f"of global ranks {group_ranks(group)}"
    except Exception:  # noqa: BLE001  (only for messages)
        return "(unknown ranks)"


def _at(where: str) -> str:
    return f'"{where}": ' if where else ""
