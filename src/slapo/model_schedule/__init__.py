"""Ready schedules for model families: one short, top-to-bottom plan per family.

``apply_schedule(model, **knobs)`` picks the plan from ``model.config.model_type``: gpt2, llama
(also mistral, qwen2, qwen3), bert (also roberta), opt, t5. Every knob is also a tuning symbol
(:func:`tuning_space`), so ``slapo tune`` explores them.

Example:
    >>> from slapo.model_schedule import apply_schedule
    >>> sch = apply_schedule(model, ckpt_ratio=0.5)       # or apply_schedule(model, "llama", ...)
    >>> sch = apply_schedule(model, **recommended_knobs("llama"))  # the best measured on CPU
    >>> model, optimizer = slapo.build(sch, init_weights=False)
"""

from __future__ import annotations

from . import bert, gpt2, llama, opt, t5  # noqa: F401  (registration)
from .knobs import ATTN_OPS, CKPT_POLICIES, CPU_DEFAULTS, Knobs, recommended_knobs
from .registry import apply_schedule, get_schedule, list_families, register_schedule
from .space import tuning_space, update_space

__all__ = [
    "ATTN_OPS",
    "CKPT_POLICIES",
    "CPU_DEFAULTS",
    "Knobs",
    "apply_schedule",
    "get_schedule",
    "list_families",
    "recommended_knobs",
    "register_schedule",
    "tuning_space",
    "update_space",
]
