"""OPT: Megatron tensor parallelism of its attention and its ReLU MLP (fc1, fc2)."""

from __future__ import annotations

from ..schedule import Schedule
from .helpers import apply_shared_knobs, blocks, column, divide_attrs, enter, require, row
from .knobs import Knobs
from .registry import register_schedule


@register_schedule("opt")
def opt(sch: Schedule, k: Knobs) -> None:
    """The OPT plan (``OPTForCausalLM``); fc1/fc2 live in the decoder layer itself."""
    layers = blocks(sch, "model.decoder.layers")
    require(not k.sequence_parallel, "sequence_parallel is implemented for gpt2 only so far")
    require(
        not k.fuse_ops,
        "fuse_ops: opt has no bias+GELU (its MLP is ReLU) and adds its "
        "residuals inside the decoder layer's forward",
    )
    if k.tensor_parallel:
        for blk in layers:
            for proj in ("q_proj", "k_proj", "v_proj"):
                column(sch, f"{blk}.self_attn.{proj}")
            row(sch, f"{blk}.self_attn.out_proj")
            enter(sch, f"{blk}.self_attn")
            divide_attrs(sch, f"{blk}.self_attn", "num_heads", "embed_dim")
            column(sch, f"{blk}.fc1")
            row(sch, f"{blk}.fc2")
            enter(sch, f"{blk}.fc1")
    apply_shared_knobs(sch, k, layers, "lm_head", shift=True)
