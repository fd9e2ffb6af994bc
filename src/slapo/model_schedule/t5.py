"""T5 (encoder-decoder): Megatron tensor parallelism of self/cross attention and the MLP; the
relative position bias is sharded over the heads."""

from __future__ import annotations

from ..schedule import Schedule
from .helpers import apply_shared_knobs, blocks
from .knobs import Knobs
from .schedule_registry import register_schedule
from .tp_plan import TPPlan, apply_tp_plan

#: One layer of an encoder or decoder block: its self attention, cross attention (decoder) or MLP.
_LAYER = "*.block.*.layer.*"

#: Megatron's plan for both stacks: q/k/v and ``wi`` (or ``wi_0``, ``wi_1``) split by columns, ``o`` and ``wo`` by rows;
#: the cross attention's k and v read the encoder states, whose gradient they all-reduce
#: themselves; the relative position bias (an embedding over the heads) is split with the heads.
#: The attentions keep their global head count and width, divided by the TP size.
T5_PLAN = TPPlan(
    {
        **{f"{_LAYER}.SelfAttention.{p}": "colwise" for p in ("q", "k", "v")},
        f"{_LAYER}.SelfAttention.o": "rowwise",
        f"{_LAYER}.SelfAttention.relative_attention_bias": "relative_bias",
        f"{_LAYER}.EncDecAttention.q": "colwise",
        f"{_LAYER}.EncDecAttention.k": "colwise_cross",
        f"{_LAYER}.EncDecAttention.v": "colwise_cross",
        f"{_LAYER}.EncDecAttention.o": "rowwise",
        # ReLU MLP (wi) or gated (T5 v1.1: wi_0, wi_1); either feeds wo
        **{f"{_LAYER}.DenseReluDense.{p}": "colwise" for p in ("wi", "wi_0", "wi_1")},
        f"{_LAYER}.DenseReluDense.wo": "rowwise",
    },
    divide={
        f"{_LAYER}.{attn}": ("n_heads", "inner_dim")
        for attn in ("SelfAttention", "EncDecAttention")
    },
)


@register_schedule(
    "t5",
    unsupported={
        "sequence_parallel": "not implemented for the encoder-decoder layout",
        "fuse_ops": "t5 has nothing to fuse (bias-free ReLU MLP)",
    },
)
def t5(sch: Schedule, k: Knobs) -> None:
    """The T5 plan (``T5ForConditionalGeneration``); stages cut the encoder and decoder blocks."""
    layers = blocks(sch, "encoder.block", "decoder.block")
    if k.tensor_parallel:
        apply_tp_plan(sch, T5_PLAN, layers)
    # The blocks that compute the relative position bias (an embedding) and hand it on: inductor
    # (torch 2.13, CPU) mis-indexes its backward there when the block keeps its dropout.
    bias_blocks = [
        blk
        for blk in layers
        if hasattr(sch[f"{blk}.layer.0"].mod.SelfAttention, "relative_attention_bias")
    ]
    apply_shared_knobs(sch, k, layers, "lm_head", shift=False, recompute_dropout_in=bias_blocks)
