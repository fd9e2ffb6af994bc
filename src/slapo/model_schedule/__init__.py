"""Ready schedules for model families, and the generic plan for every other model.

``apply_schedule(model, **knobs)`` picks the plan from ``model.config.model_type``: gpt2, llama
(also mistral, qwen2, qwen3), bert (also roberta), opt, t5; any other model gets the generic
plan (its blocks found from ``_no_split_modules``, tensor parallelism from its own
``base_model_tp_plan`` or inferred). Every plan applies its concerns in one order: tensor
parallelism (a :class:`TPPlan`, data applied by :func:`apply_tp_plan`), the attention kernel,
checkpointing, compilation, pipeline cuts (``helpers.apply_shared_knobs``). With no knobs it is
the recommended schedule. Every knob is also a tuning symbol (:func:`slapo.tune.schedule_space.tuning_space`).

Example:
    >>> import slapo
    >>> from slapo.model_schedule import apply_schedule
    >>> import transformers
    >>> config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)
    >>> model = transformers.GPT2LMHeadModel(config)
    >>> sch = apply_schedule(model)                        # the recommended schedule
    >>> sch = apply_schedule(model, ckpt_ratio=0.5)        # exactly this, nothing else
    >>> # on each rank of a tensor-parallel job (torchrun): not run here
    >>> tp_group = slapo.sharding.init_parallel_mesh("cpu", tp=2)["tp"]  # doctest: +SKIP
    >>> sch = apply_schedule(model, group=tp_group)        # recommended, tensor-parallel  # doctest: +SKIP
    >>> model, optimizer = slapo.build(sch, init_weights=False)
"""

from __future__ import annotations

from . import (  # noqa: F401  (registration)
    bert,
    gpt2,
    llama,
    opt,
    t5,
    wideresnet,  # noqa: F401  (registration)
)
from .generic_plan import GENERIC_KNOBS, find_blocks, infer_plan
from .knobs import ATTN_OPS, CKPT_POLICIES, CPU_DEFAULTS, LAYOUT_KNOBS, Knobs, recommended_knobs
from .schedule_registry import (
    apply_schedule,
    family_limits,
    get_schedule,
    list_families,
    register_schedule,
)
from .tp_plan import STYLES, TPPlan, apply_tp_plan, from_hf_plan

__all__ = [
    "ATTN_OPS",
    "CKPT_POLICIES",
    "CPU_DEFAULTS",
    "GENERIC_KNOBS",
    "LAYOUT_KNOBS",
    "STYLES",
    "Knobs",
    "TPPlan",
    "apply_schedule",
    "apply_tp_plan",
    "family_limits",
    "find_blocks",
    "from_hf_plan",
    "get_schedule",
    "infer_plan",
    "list_families",
    "recommended_knobs",
    "register_schedule",
]
