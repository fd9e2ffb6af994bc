"""OPT: Megatron tensor parallelism of its attention and its ReLU MLP (fc1, fc2)."""

from __future__ import annotations

from ..schedule import Schedule
from .helpers import apply_shared_knobs, blocks
from .knobs import Knobs
from .schedule_registry import register_schedule
from .tp_plan import TPPlan, apply_tp_plan

#: fc1/fc2 live in the decoder layer itself: fc1 is entered on its own. OPT's attention keeps
#: its global head count and width, divided by the TP size.
OPT_PLAN = TPPlan(
    {
        "model.decoder.layers.*.self_attn.q_proj": "colwise",
        "model.decoder.layers.*.self_attn.k_proj": "colwise",
        "model.decoder.layers.*.self_attn.v_proj": "colwise",
        "model.decoder.layers.*.self_attn.out_proj": "rowwise",
        "model.decoder.layers.*.fc1": "colwise",
        "model.decoder.layers.*.fc2": "rowwise",
    },
    divide={"model.decoder.layers.*.self_attn": ("num_heads", "embed_dim")},
)


@register_schedule(
    "opt",
    unsupported={
        "fuse_ops": "opt has no bias+GELU (its MLP is ReLU) and adds its residuals inside the "
        "decoder layer's forward",
        "sequence_parallel": "its MLP sits directly in the decoder layer, with no module of its "
        "own to gather the sequence at",
    },
)
def opt(sch: Schedule, k: Knobs) -> None:
    """The OPT plan (``OPTForCausalLM``)."""
    layers = blocks(sch, "model.decoder.layers")
    if k.tensor_parallel:
        apply_tp_plan(sch, OPT_PLAN, layers, k.sequence_parallel)
    apply_shared_knobs(sch, k, layers, "lm_head", shift=True)
