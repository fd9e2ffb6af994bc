"""GPT-2: Megatron tensor parallelism with a vocabulary-parallel tied embedding/LM head, and
sequence parallelism over the norms and the row-parallel biases."""

from __future__ import annotations

from ..schedule import Schedule
from .fusion import fuse_bias_gelu
from .helpers import apply_shared_knobs, blocks, require
from .knobs import Knobs
from .schedule_registry import register_schedule
from .tp_plan import TPPlan, apply_tp_plan
from .tp_styles import PackedColwise

#: Megatron's plan: q, k and v stacked in one Conv1D (each third split on its own) and the
#: MLP's first projection by columns, the outputs by rows; the embedding split over the
#: vocabulary, and the LM head tied to it gathers its logits. The attention keeps its global
#: sizes (``split_size`` splits the fused q/k/v output), divided by the TP size.
GPT2_PLAN = TPPlan(
    {
        "transformer.h.*.attn.c_attn": PackedColwise(parts=3),
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "transformer.wte": "vocab_embedding",
    },
    divide={"transformer.h.*.attn": ("split_size", "embed_dim", "num_heads")},
)


@register_schedule("gpt2")
def gpt2(sch: Schedule, k: Knobs) -> None:
    """The GPT-2 plan (``GPT2LMHeadModel``)."""
    layers = blocks(sch, "transformer.h")
    require(
        not (k.fused_loss and k.tensor_parallel),
        "gpt2: fused_loss with group= is not "
        "supported: the tied LM head is vocabulary-parallel; drop one of them",
    )
    if k.tensor_parallel:
        # under sequence parallelism the norms and row biases between the regions sum their
        # gradients (the region rule), the sequence split from the first block to the last
        apply_tp_plan(sch, GPT2_PLAN, layers, k.sequence_parallel)
    if k.fuse_ops:
        for blk in layers:
            fuse_bias_gelu(sch, f"{blk}.mlp.c_fc", f"{blk}.mlp.act")
    apply_shared_knobs(sch, k, layers, "lm_head", shift=True)
