"""What the build targets share: optimizer construction, distributed checks, meshes, blocks.

Example:
    >>> from slapo.targets.common import make_optimizer
    >>> opt = make_optimizer(torch.nn.Linear(2, 2), torch.optim.SGD, {"lr": 0.1})
    >>> type(opt).__name__
    'SGD'
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..exceptions import TargetError

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = [
    "OptimizerSpec",
    "as_device_mesh",
    "as_process_group",
    "default_blocks",
    "default_device",
    "make_optimizer",
    "require_distributed",
]

OptimizerSpec = type[torch.optim.Optimizer] | Callable[..., torch.optim.Optimizer] | None


# ----- optimizers --------------------------------------------------------------------------------
def make_optimizer(
    model: nn.Module | Iterable[torch.Tensor],
    optimizer: OptimizerSpec,
    optimizer_kwargs: dict[str, Any] | None,
) -> torch.optim.Optimizer | None:
    """Build ``optimizer(trainable params, **optimizer_kwargs)``, or None when not asked for.

    ``model`` is a module (its parameters are used) or the parameters themselves.

    Example:
        >>> make_optimizer(nn.Linear(2, 2), None, None) is None
        True
    """
    if optimizer is None:
        if optimizer_kwargs:
            raise TargetError(
                "optimizer_kwargs given without optimizer=; pass e.g. optimizer=torch.optim.AdamW"
            )
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TargetError(
            "optimizer= takes a class or factory (e.g. torch.optim.AdamW), not an instance: the "
            "target creates it over the built model's parameters"
        )
    if not callable(optimizer):
        raise TargetError(f"optimizer= must be an optimizer class or a callable, got {optimizer!r}")
    source = model.parameters() if isinstance(model, nn.Module) else model
    params = [p for p in source if p.requires_grad]
    return optimizer(params, **(optimizer_kwargs or {}))


# ----- processes, groups, meshes -----------------------------------------------------------------
def require_distributed(target: str) -> None:
    """Raise a :class:`TargetError` naming ``target`` when no process group is running.

    Example:
        >>> require_distributed("ddp")  # without slapo.env.setup()
        Traceback (most recent call last):
        slapo.exceptions.TargetError: target "ddp" needs torch.distributed: ...
    """
    if not dist.is_available() or not dist.is_initialized():
        raise TargetError(
            f'target "{target}" needs torch.distributed: call slapo.env.setup() (or '
            "torch.distributed.init_process_group) in every process first"
        )


def as_process_group(group: Any, target: str) -> dist.ProcessGroup | None:
    """The process group of ``group``: a ProcessGroup, a 1-D DeviceMesh, or None (the world).

    Example:
        >>> import slapo
        >>> # on each rank of a 4-rank job with dp=2, tp=2 (torchrun): not run here
        >>> mesh = slapo.sharding.init_parallel_mesh("cpu", tp=2)  # doctest: +SKIP
        >>> as_process_group(mesh["dp"], "ddp")  # a 2-D mesh's data-parallel dimension  # doctest: +SKIP
    """
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
    """A 1-D DeviceMesh over ``group`` (None: every rank), as FSDP2 wants one.

    Example:
        >>> import slapo
        >>> env = slapo.env.setup(rank=0, world_size=1)
        >>> as_device_mesh(None, "fsdp", "cpu").size() == dist.get_world_size()
        True
    """
    if isinstance(group, DeviceMesh):
        as_process_group(group, target)  # validates that it is 1-D
        return group
    pg = as_process_group(group, target)
    if pg is None:
        return init_device_mesh(device_type, (dist.get_world_size(),))
    return DeviceMesh.from_group(pg, device_type)


def default_device() -> torch.device:
    """This process's CUDA device when there is one, else the CPU.

    Example:
        >>> default_device().type in ("cuda", "cpu")
        True
    """
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----- the model's blocks ------------------------------------------------------------------------
def default_blocks(sch: Schedule) -> list[str]:
    """The paths of every block in a list of layers (``transformer.h.0``, ...), pre-order.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)
        >>> gpt2 = transformers.GPT2LMHeadModel(config)
        >>> import slapo
        >>> default_blocks(slapo.create_schedule(gpt2))
        ['transformer.h.0', 'transformer.h.1']
    """
    blocks: list[str] = []
    for path, child in sch.named_schedules():
        if child.parent is not None and child.parent.is_module_list:
            if not any(path.startswith(b + ".") for b in blocks):
                blocks.append(path)
    return blocks
