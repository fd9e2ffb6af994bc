"""Llama, and the families sharing its layout: Mistral, Qwen2 and Qwen3 (dense)."""

from __future__ import annotations

from ..schedule import Schedule
from .helpers import apply_shared_knobs, blocks, per_head_norms
from .knobs import Knobs
from .schedule_registry import register_schedule
from .tp_plan import TPPlan, apply_tp_plan

#: Megatron's plan: q/k/v (Qwen2 gives them a bias) and gate/up split by columns, the outputs by
#: rows; K/V heads must divide by the TP size.
LLAMA_PLAN = TPPlan(
    {
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
    }
)


@register_schedule(
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    unsupported={
        "fuse_ops": "its MLP is SiLU-gated and bias-free, its residuals carry no bias: nothing "
        "to fuse",
    },
)
def llama(sch: Schedule, k: Knobs) -> None:
    """The Llama plan (``LlamaForCausalLM`` and look-alikes)."""
    layers = blocks(sch, "model.layers")
    if k.tensor_parallel:
        for blk in layers:  # Qwen3's q_norm/k_norm must normalize one head (else: an error)
            per_head_norms(sch, f"{blk}.self_attn")
        # the region rule sums the gradients of the per-head norms over the group
        apply_tp_plan(sch, LLAMA_PLAN, layers, k.sequence_parallel)
    apply_shared_knobs(sch, k, layers, "lm_head", shift=True)
