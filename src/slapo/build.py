"""``slapo.build``: turn a schedule into a model (and optimizer) that trains on a target."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .exceptions import SlapoError
from .initialization import has_meta_tensors, materialize_module
from .logger import get_logger
from .precision import Precision
from .schedule import Schedule
from .targets import init_target_engine

__all__ = ["build"]


def build(
    sch: Schedule,
    target: str | None = None,
    init_weights: bool | Callable[[nn.Module], None] = True,
    precision: Precision | str | torch.dtype | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """Build the scheduled model for ``target``; returns ``(model, optimizer)``.

    Every target honours one training-loop contract (:mod:`slapo.targets.contract`):
    ``loss = slapo.train_step(model, batch)``, then ``optimizer.step()`` and
    ``optimizer.zero_grad()``.

    Args:
        sch: the root schedule.
        target: ``None``/``"eager"`` for single-process training; other targets (``"ddp"``,
            ``"fsdp"``, ``"pipeline"``, ``"roundpipe"``, ``"deepspeed"``) as installed:
            ``slapo.targets.list_targets()``.
        init_weights: for a model created under ``init_empty_weights``: ``True`` materializes it
            with the model's own initialization, a callable ``fn(module)`` initializes each
            materialized module instead, ``False`` leaves it on the meta device (e.g. for
            ``consolidate_model``). A model with real weights is never re-initialized.
        precision: ``"fp32"`` (the default), or mixed precision ``"bf16"``/``"fp16"`` (or a
            dtype, or a :class:`slapo.precision.Precision`): float32 master weights and
            optimizer state, compute in the lower dtype, each target with its engine's own
            mechanism (autocast for eager, ddp and pipeline stages; FSDP2's
            ``MixedPrecisionPolicy``; DeepSpeed's bf16/fp16 section; RoundPipe's low-precision
            model with float32 optimizer copies). fp16 scales the loss: ``slapo.train_step``
            scales it and the optimizer skips a step that overflowed, on every rank alike.
        **kwargs: options of the target, e.g. ``device=``, ``optimizer=torch.optim.AdamW``,
            ``optimizer_kwargs={"lr": 1e-3}``.

    Example:
        >>> import slapo
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4)))
        >>> model, optimizer = slapo.build(
        ...     sch, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}
        ... )
        >>> x, y = torch.randn(2, 4), torch.randn(2, 4)
        >>> loss = slapo.train_step(model, (x, y), loss_fn=torch.nn.functional.mse_loss)
        >>> optimizer.step(); optimizer.zero_grad()

        Mixed precision (bf16 compute, float32 master weights):

        >>> model, optimizer = slapo.build(
        ...     slapo.create_schedule(nn.Sequential(nn.Linear(4, 4))), precision="bf16",
        ...     optimizer=torch.optim.AdamW,
        ... )
        >>> loss = slapo.train_step(model, (x, y), loss_fn=torch.nn.functional.mse_loss)
        >>> model[0].weight.dtype, model(x).dtype
        (torch.float32, torch.bfloat16)
    """
    if not isinstance(sch, Schedule):
        raise SlapoError(
            f"build needs a Schedule (slapo.create_schedule(model)), got {type(sch).__name__}"
        )
    if sch.parent is not None:
        raise SlapoError(
            f'build needs the root schedule, got the child "{sch.path}"; pass the root'
        )
    if init_weights and has_meta_tensors(sch.mod):
        init_fn = init_weights if callable(init_weights) else None
        materialized = materialize_module(sch.mod, init_fn=init_fn)
        get_logger().debug("materialized %d modules from the meta device", len(materialized))
    if precision is not None:
        kwargs["precision"] = Precision.of(precision)
    return init_target_engine(sch, target, **kwargs)
