"""The ``"fsdp"`` target: fully sharded data parallelism on FSDP2 (``fully_shard``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..exceptions import TargetError
from ..logger import get_logger
from ..precision import PRECISIONS, Precision
from .common import (
    OptimizerSpec,
    as_device_mesh,
    default_blocks,
    make_optimizer,
    require_distributed,
)
from .mixed_precision import device_type_of, with_loss_scaling
from .target_registry import register_target

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = ["build_fsdp"]


@register_target("fsdp", distributed=True, precisions=PRECISIONS, device_option=True, memory="fsdp")
def build_fsdp(
    sch: Schedule,
    device: torch.device | str | None = None,
    optimizer: OptimizerSpec = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    group: Any = None,
    wrap: Sequence[str] | None = None,
    mp_policy: Any = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    precision: Precision | str | torch.dtype | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Shard every block, then the root, with FSDP2 ``fully_shard`` over ``group`` (default: world).

    Args:
        group: a ProcessGroup or 1-D DeviceMesh; with tensor parallelism on a 2-D mesh pass
            ``mesh["dp"]``.
        wrap: the paths sharded as units of their own (default: the blocks of every layer list,
            see :func:`slapo.targets.common.default_blocks`); the root is always sharded last.
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``; or give the shorthands
            ``param_dtype=`` / ``reduce_dtype=``.
        precision: ``"bf16"``/``"fp16"``: ``MixedPrecisionPolicy(param_dtype=<that dtype>,
            reduce_dtype=torch.float32)``: float32 sharded parameters and optimizer state,
            gathered in the compute dtype, gradients reduced in float32; fp16 also scales the
            loss with a ``ShardedGradScaler``. Give it or ``mp_policy``, not both.
        reshard_after_forward: free gathered parameters after forward (ZeRO-3) or keep them
            until backward (ZeRO-2 like).

    Parameters become ``DTensor`` shards with their user-visible names; ``p.full_tensor()``
    gathers one.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)
        >>> gpt2 = transformers.GPT2LMHeadModel(config)
        >>> import slapo
        >>> env = slapo.env.setup(rank=0, world_size=1)  # a world of one here
        >>> sch = slapo.create_schedule(gpt2)
        >>> model, opt = slapo.build(sch, target="fsdp", optimizer=torch.optim.AdamW,
        ...                          precision="bf16")
    """
    # deferred: FSDP2 loads torch.distributed.tensor (0.65 s), which `import slapo` does not need
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    require_distributed("fsdp")
    if mp_policy is not None and (param_dtype is not None or reduce_dtype is not None):
        raise TargetError(
            'target "fsdp": give either mp_policy= or the param_dtype=/reduce_dtype= shorthands'
        )
    precision = Precision.of(precision)
    if precision.mixed and (mp_policy is not None or param_dtype or reduce_dtype):
        raise TargetError(
            f'target "fsdp": precision={precision.name!r} sets the MixedPrecisionPolicy; give '
            "it or mp_policy=/param_dtype=/reduce_dtype=, not both"
        )
    if precision.mixed:
        param_dtype, reduce_dtype = precision.compute_dtype, torch.float32
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = sch.mod if device is None else sch.mod.to(device)
    device_type = device_type_of(model)
    precision.check_device(device_type)
    mesh = as_device_mesh(group, "fsdp", device_type)
    paths = default_blocks(sch) if wrap is None else list(wrap)
    for path in paths:
        if path not in sch or not path:
            raise TargetError(f'target "fsdp": wrap= names "{path}", which is no submodule path')
    opts = {"mesh": mesh, "mp_policy": mp_policy, "reshard_after_forward": reshard_after_forward}
    for path in paths:
        fully_shard(model.get_submodule(path), **opts)
    fully_shard(model, **opts)
    get_logger().info("fsdp: sharded %d blocks and the root over %d ranks", len(paths), mesh.size())
    optim = make_optimizer(model, optimizer, optimizer_kwargs)
    return with_loss_scaling(model, optim, precision, device_type, sharded=True)
