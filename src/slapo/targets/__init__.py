"""Build targets ("framework dialects"): how a schedule becomes something that trains.

Each target registers its builder by name (:func:`register_target`); ``slapo.build`` calls the
builder of the requested target. Every target honours one training-loop contract, stated in
:mod:`slapo.targets.contract`::

    model, optimizer = slapo.build(sch, target=..., optimizer=torch.optim.AdamW)
    loss = slapo.train_step(model, batch)   # forward and backward of one batch
    optimizer.step(); optimizer.zero_grad()

:mod:`slapo.targets.common` holds what the targets share (optimizers, process groups, blocks).
"""

from __future__ import annotations

from . import ddp, deepspeed, eager, fsdp, pipeline, roundpipe  # noqa: F401  (registration)
from .contract import train_step
from .target_registry import (
    TargetRecord,
    get_dialect_cls,
    get_record,
    get_target,
    init_target_engine,
    list_targets,
    register_target,
)

__all__ = [
    "TargetRecord",
    "get_record",
    "get_dialect_cls",
    "get_target",
    "init_target_engine",
    "list_targets",
    "register_target",
    "train_step",
]
