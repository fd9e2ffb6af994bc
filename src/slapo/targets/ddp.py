"""The ``"ddp"`` target: data parallelism on ``torch.nn.parallel.DistributedDataParallel``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..exceptions import TargetError
from ..precision import PRECISIONS, Precision
from ..sharding.expert_grads import expert_param_names
from ..surgery import carry_signature
from .common import OptimizerSpec, as_process_group, make_optimizer, require_distributed
from .mixed_precision import autocast_forward, device_type_of, with_loss_scaling
from .target_registry import register_target

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = ["build_ddp"]


@register_target("ddp", distributed=True, precisions=PRECISIONS, device_option=True, memory="ddp")
def build_ddp(
    sch: Schedule,
    device: torch.device | str | None = None,
    optimizer: OptimizerSpec = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    group: Any = None,
    precision: Precision | str | torch.dtype | None = None,
    **ddp_kwargs: Any,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Wrap the scheduled model in ``DistributedDataParallel`` over ``group`` (default: world).

    Gradients are averaged over the group, so each rank trains on its own slice of the batch.
    With tensor parallelism on a 2-D mesh pass ``group=mesh["dp"]``: sharded parameters are
    plain tensors, each averaged with its peers holding the same shard. Expert-parallel
    weights hooked by ``slapo.sharding.reduce_expert_grads`` are left to their hooks.

    ``precision="bf16"``/``"fp16"``: float32 parameters and gradients (all-reduced in float32),
    the forward under ``torch.autocast``; fp16 scales the loss with a ``ShardedGradScaler``,
    so every rank skips the same overflowed steps.

    ``inspect.signature(model.forward)`` is the scheduled model's (not DDP's ``*inputs``), so
    Hugging Face ``Trainer`` keeps the dataset columns the model takes.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)
        >>> gpt2 = transformers.GPT2LMHeadModel(config)
        >>> import slapo
        >>> env = slapo.env.setup()  # a world of one here; torchrun's ranks in a job
        >>> sch = slapo.create_schedule(gpt2)
        >>> ids = torch.randint(0, 50257, (2, 8))
        >>> batch_slice_of_this_rank = {"input_ids": ids, "labels": ids}
        >>> model, opt = slapo.build(sch, target="ddp", optimizer=torch.optim.AdamW)
        >>> loss = slapo.train_step(model, batch_slice_of_this_rank); opt.step(); opt.zero_grad()
    """
    require_distributed("ddp")
    precision = Precision.of(precision)
    pg = as_process_group(group, "ddp")
    model = sch.mod if device is None else sch.mod.to(device)
    device_type = device_type_of(model)
    precision.check_device(device_type)
    # float32 parameters (the master weights) and gradients, all-reduced in float32
    autocast_forward(model, precision, device_type)
    dev_ids = None if device_type == "cpu" else [next(model.parameters()).device]
    # expert-parallel weights hold different experts on different ranks: their own hooks
    # reduce their gradients (slapo.sharding.expert_grads), DDP must not average them
    ignored = expert_param_names(model)
    if ignored:
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, ignored
        )
    try:
        wrapped = nn.parallel.DistributedDataParallel(
            model, device_ids=dev_ids, process_group=pg, **ddp_kwargs
        )
    except TypeError as exc:  # a misspelt option: name it
        raise TargetError(f'target "ddp": bad option for DistributedDataParallel: {exc}') from exc
    carry_signature(wrapped, model)  # DDP's forward(*inputs, **kwargs) shows the model's own
    optim = make_optimizer(wrapped, optimizer, optimizer_kwargs)
    # tensor-parallel shards differ between ranks: every rank's inf check is agreed on
    return with_loss_scaling(wrapped, optim, precision, device_type, sharded=True)
