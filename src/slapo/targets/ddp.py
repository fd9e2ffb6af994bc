"""The ``"ddp"`` target: data parallelism on ``torch.nn.parallel.DistributedDataParallel``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..exceptions import TargetError
from .common import OptimizerSpec, as_process_group, make_optimizer, require_distributed
from .registry import register_target

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = ["build_ddp"]


@register_target("ddp")
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
        >>> loss = slapo.train_step(model, batch_slice_of_this_rank); opt.step(); opt.zero_grad()
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
