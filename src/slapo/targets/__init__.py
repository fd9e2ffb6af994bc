"""Build targets ("framework dialects"): how a schedule becomes something that trains.

Each target registers classes by ``(cls_type, target)``; ``build`` asks for the
``"runtime_engine"`` of the requested target. Later targets (ddp, fsdp, pipeline, roundpipe,
deepspeed) register themselves the same way.
"""

from __future__ import annotations

from . import ddp, deepspeed, eager, fsdp, pipeline, roundpipe  # noqa: E402,F401,I001  (registration)
from .registry import get_dialect_cls, init_target_engine, list_targets, register_dialect

__all__ = ["get_dialect_cls", "init_target_engine", "list_targets", "register_dialect"]
