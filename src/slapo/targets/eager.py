"""The single-process eager target: the scheduled module itself, plus an optional optimizer."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..exceptions import TargetError
from .registry import register_dialect

if TYPE_CHECKING:
    from ..schedule import Schedule

OptimizerSpec = type[torch.optim.Optimizer] | Callable[..., torch.optim.Optimizer] | None


def make_optimizer(
    model: nn.Module | Iterable[torch.Tensor],
    optimizer: OptimizerSpec,
    optimizer_kwargs: dict[str, Any] | None,
) -> torch.optim.Optimizer | None:
    """Build ``optimizer(trainable params, **optimizer_kwargs)``, or None when not asked for.

    ``model`` is a module (its parameters are used) or the parameters themselves.
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


@register_dialect("runtime_engine", "eager")
def build_eager(
    sch: Schedule,
    device: torch.device | str | None = None,
    optimizer: OptimizerSpec = None,
    optimizer_kwargs: dict[str, Any] | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Single process: returns the scheduled module (moved to ``device``) and an optional optimizer."""
    model = sch.mod
    if device is not None:
        model = model.to(device)
    return model, make_optimizer(model, optimizer, optimizer_kwargs)
