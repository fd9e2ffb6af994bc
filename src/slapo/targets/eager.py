"""The single-process eager target: the scheduled module itself, plus an optional optimizer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .common import OptimizerSpec, make_optimizer
from .registry import register_target

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = ["build_eager"]


@register_target("eager")
def build_eager(
    sch: Schedule,
    device: torch.device | str | None = None,
    optimizer: OptimizerSpec = None,
    optimizer_kwargs: dict[str, Any] | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Single process: returns the scheduled module (moved to ``device``) and an optional optimizer.

    Example:
        >>> model, opt = slapo.build(sch, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
        >>> loss = slapo.train_step(model, batch); opt.step(); opt.zero_grad()
    """
    model = sch.mod
    if device is not None:
        model = model.to(device)
    return model, make_optimizer(model, optimizer, optimizer_kwargs)
