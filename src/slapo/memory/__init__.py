"""The memory planner: the memory of one training step, per rank, for every target and layout.

* :mod:`~slapo.memory.estimate`: :func:`estimate_memory`, one fake step of a schedule's module
  (the eager target, or one tensor-parallel rank);
* :mod:`~slapo.memory.targets`: :func:`estimate_layout`, what one rank of a ``dp x pp x tp``
  layout holds under ddp, fsdp, deepspeed (ZeRO 1-3), the pipeline (GPipe, 1F1B) or RoundPipe;
* :mod:`~slapo.memory.units`: byte sizes as people write them (``"8GiB"``);
* :mod:`~slapo.memory.measure`: what the estimate is checked against on a real run:
  :class:`LiveSaved`, the most bytes saved for backward alive at once (the activations), and
  :class:`EngineBytes`, a data-parallel engine's own buffers (the ``engine`` bytes).

Nothing here allocates the model: fake tensors stand in for it. Fake tensors load on first use.

Example:
    >>> from slapo.memory import estimate_layout, format_bytes
    >>> est = estimate_layout(sch, batch, target="fsdp", dp=4)
    >>> format_bytes(est.required)
    '1.52 GiB'
"""

from __future__ import annotations

from .estimate import EstimateError, MemoryEstimate, estimate_memory, fake_process_group
from .measure import EngineBytes, LiveSaved
from .targets import (
    LAYOUT_TARGETS,
    PIPELINE_SCHEDULES,
    LayoutSpec,
    apply_layout,
    estimate_layout,
    roundpipe_resident,
)
from .units import MemorySizeError, format_bytes, memory_size_arg, parse_bytes

__all__ = [
    "LAYOUT_TARGETS",
    "PIPELINE_SCHEDULES",
    "EngineBytes",
    "EstimateError",
    "LayoutSpec",
    "LiveSaved",
    "MemoryEstimate",
    "MemorySizeError",
    "apply_layout",
    "estimate_layout",
    "estimate_memory",
    "fake_process_group",
    "format_bytes",
    "memory_size_arg",
    "parse_bytes",
    "roundpipe_resident",
]
