"""The single-process eager target: the scheduled module itself, plus an optional optimizer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..precision import PRECISIONS, Precision
from .common import OptimizerSpec, make_optimizer
from .mixed_precision import autocast_forward, device_type_of, with_loss_scaling
from .target_registry import register_target

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = ["build_eager"]


@register_target("eager", precisions=PRECISIONS, device_option=True, memory="eager")
def build_eager(
    sch: Schedule,
    device: torch.device | str | None = None,
    optimizer: OptimizerSpec = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    precision: Precision | str | torch.dtype | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Single process: returns the scheduled module (moved to ``device``) and an optional optimizer.

    With ``precision="bf16"`` (or ``"fp16"``) the parameters stay float32 (the master weights
    the optimizer steps) and the forward runs under ``torch.autocast``; fp16 also scales the loss
    (:mod:`slapo.targets.mixed_precision`).

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)
        >>> gpt2 = transformers.GPT2LMHeadModel(config)
        >>> import slapo
        >>> sch = slapo.create_schedule(gpt2)
        >>> ids = torch.randint(0, 50257, (2, 8))
        >>> batch = {"input_ids": ids, "labels": ids}
        >>> model, opt = slapo.build(sch, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
        >>> loss = slapo.train_step(model, batch); opt.step(); opt.zero_grad()
        >>> sch = slapo.create_schedule(transformers.GPT2LMHeadModel(config))
        >>> model, opt = slapo.build(sch, precision="bf16", optimizer=torch.optim.AdamW)
    """
    precision = Precision.of(precision)
    model = sch.mod
    if device is not None:
        model = model.to(device)
    device_type = device_type_of(model)
    precision.check_device(device_type)
    autocast_forward(model, precision, device_type)
    optim = make_optimizer(model, optimizer, optimizer_kwargs)
    return with_loss_scaling(model, optim, precision, device_type)
