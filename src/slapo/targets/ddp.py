"""The ``"ddp"`` target: data parallelism on ``torch.nn.parallel.DistributedDataParallel``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..exceptions import TargetError
from .eager import OptimizerSpec, make_optimizer
from .registry import register_dialect

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..schedule import Schedule

__all__ = ["build_ddp", "require_distributed", "as_process_group", "as_device_mesh"]


def require_distributed(target: str) -> None:
    """Raise a :class:`TargetError` naming ``target`` when no process group is running."""
    if not dist.is_available() or not dist.is_initialized():
        raise TargetError(
            f'target "{target}" needs torch.distributed: call slapo.env.setup() (or '
            "torch.distributed.init_process_group) in every process first"
        )


def as_process_group(group: Any, target: str) -> dist.ProcessGroup | None:
    """The process group of ``group``: a ProcessGroup, a 1-D DeviceMesh, or None (the world)."""
    from torch.distributed.device_mesh import DeviceMesh

    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            names = group.mesh_dim_names or ("dp",)
            raise TargetError(
                f'target "{target}": group= got a {group.ndim}-D DeviceMesh; pass the '
                f"data-parallel dimension of it, e.g. mesh[{names[0]!r}]"
            )
        return group.get_group()
    raise TargetError(
        f'target "{target}": group= takes a ProcessGroup or a 1-D DeviceMesh, got '
        f"{type(group).__name__}"
    )


def as_device_mesh(group: Any, target: str, device_type: str) -> DeviceMesh:
    """A 1-D DeviceMesh over ``group`` (None: every rank), as FSDP2 wants one."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if isinstance(group, DeviceMesh):
        as_process_group(group, target)  # validates that it is 1-D
        return group
    pg = as_process_group(group, target)
    if pg is None:
        return init_device_mesh(device_type, (dist.get_world_size(),))
    return DeviceMesh.from_group(pg, device_type)


@register_dialect("runtime_engine", "ddp")
def build_ddp(
    sch: Schedule,
    device: torch.device | str | None = None,
    optimizer: OptimizerSpec = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    group: Any = None,
    **ddp_kwargs: Any,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Wrap the scheduled model in ``DistributedDataParallel`` over ``group`` (default: world).

    Gradients are averaged over the group, so each rank trains on its own slice of the batch.
    With tensor parallelism on a 2-D mesh pass ``group=mesh["dp"]``: sharded parameters are
    plain tensors, each averaged with its peers holding the same shard.

    Example:
        >>> slapo.env.setup()
        >>> model, opt = slapo.build(sch, target="ddp", optimizer=torch.optim.AdamW)
        >>> model(**batch_slice_of_this_rank).loss.backward(); opt.step()
    """
    require_distributed("ddp")
    pg = as_process_group(group, "ddp")
    model = sch.mod if device is None else sch.mod.to(device)
    on_cpu = next(model.parameters()).device.type == "cpu"
    dev_ids = None if on_cpu else [next(model.parameters()).device]
    try:
        wrapped = nn.parallel.DistributedDataParallel(
            model, device_ids=dev_ids, process_group=pg, **ddp_kwargs
        )
    except TypeError as exc:  # a misspelt option: name it
        raise TargetError(f'target "ddp": bad option for DistributedDataParallel: {exc}') from exc
    return wrapped, make_optimizer(wrapped, optimizer, optimizer_kwargs)
