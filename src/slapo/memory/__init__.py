"""The memory planner: the memory of one training step, per rank, for every target and layout.

* :mod:`~slapo.memory.estimate`: :func:`estimate_memory`, one fake step of a schedule's module
  (the eager target, or one tensor-parallel rank);
* :mod:`~slapo.memory.targets`: :func:`estimate_layout`, what one rank of a ``dp x pp x cp x tp``
  layout (with ``ep`` expert parallelism) holds under ddp, fsdp, deepspeed (ZeRO 1-3), the
  pipeline (GPipe, 1F1B) or RoundPipe;
* :mod:`~slapo.memory.stand_ins`: what the fake step runs in place of the ops of a
  mixture-of-experts step that cannot run on fake tensors;
* :mod:`~slapo.memory.units`: byte sizes as people write them (``"8GiB"``), and what CUDA's
  caching allocator reserves for them (:func:`reserved_bytes`);
* :mod:`~slapo.memory.measure`: what the estimate is checked against on a real run:
  :class:`LiveSaved`, the most bytes saved for backward alive at once (the activations), and
  :class:`EngineBytes`, a data-parallel engine's own buffers (the ``engine`` bytes).

Nothing here allocates the model: fake tensors stand in for it. Fake tensors load on first use.
Every estimate is in a precision: fp32, or mixed bf16/fp16 as the target's engine runs it
(float32 master weights and optimizer state; see :func:`estimate_layout`).

Example:
    >>> import slapo, torch, transformers
    >>> from slapo.memory import estimate_layout, format_bytes
    >>> config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4)
    >>> sch = slapo.create_schedule(transformers.GPT2LMHeadModel(config))
    >>> ids = torch.zeros(8, 128, dtype=torch.long)
    >>> batch = {"input_ids": ids, "labels": ids}
    >>> est = estimate_layout(sch, batch, target="fsdp", dp=4)
    >>> format_bytes(est.required)
    '836.13 MiB'
    >>> est = estimate_layout(sch, batch, target="fsdp", dp=4, precision="bf16", device="cuda")
    >>> est.reserved >= est.required
    True
"""

from __future__ import annotations

from .estimate import (
    MASTER_WEIGHTS,
    EstimateError,
    MemoryEstimate,
    estimate_memory,
    fake_layout_groups,
    fake_process_group,
)
from .measure import EngineBytes, LiveSaved
from .targets import (
    LAYOUT_TARGETS,
    PIPELINE_SCHEDULES,
    LayoutSpec,
    apply_layout,
    estimate_layout,
    layout_step,
    roundpipe_resident,
)
from .units import (
    RESERVED_ALLOWANCE,
    MemorySizeError,
    allocator_rounding,
    format_bytes,
    memory_size_arg,
    parse_bytes,
    reserved_bytes,
)

__all__ = [
    "LAYOUT_TARGETS",
    "MASTER_WEIGHTS",
    "PIPELINE_SCHEDULES",
    "RESERVED_ALLOWANCE",
    "EngineBytes",
    "EstimateError",
    "LayoutSpec",
    "LiveSaved",
    "MemoryEstimate",
    "MemorySizeError",
    "allocator_rounding",
    "apply_layout",
    "estimate_layout",
    "layout_step",
    "estimate_memory",
    "fake_layout_groups",
    "fake_process_group",
    "format_bytes",
    "memory_size_arg",
    "parse_bytes",
    "reserved_bytes",
    "roundpipe_resident",
]
