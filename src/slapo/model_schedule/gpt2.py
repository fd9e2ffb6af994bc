"""GPT-2: Megatron tensor parallelism with a vocabulary-parallel tied embedding/LM head, and
sequence parallelism over the norms and the row-parallel biases."""

from __future__ import annotations

from ..schedule import Schedule
from .fusion import fuse_bias_gelu
from .helpers import (
    apply_shared_knobs,
    blocks,
    column,
    divide_attrs,
    enter,
    replicated,
    require,
    row,
)
from .knobs import Knobs
from .registry import register_schedule


@register_schedule("gpt2")
def gpt2(sch: Schedule, k: Knobs) -> None:
    """The GPT-2 plan (``GPT2LMHeadModel``)."""
    layers, sp = blocks(sch, "transformer.h"), k.sequence_parallel
    require(
        not (k.fused_loss and k.tensor_parallel),
        "gpt2: fused_loss with group= is not "
        "supported: the tied LM head is vocabulary-parallel; drop one of them",
    )
    if k.tensor_parallel:
        for blk in layers:
            column(sch, f"{blk}.attn.c_attn", fused=3)  # q, k, v are stacked in one weight
            row(sch, f"{blk}.attn.c_proj", sp)
            enter(sch, f"{blk}.attn", sp)
            divide_attrs(sch, f"{blk}.attn", "split_size", "embed_dim", "num_heads")
            column(sch, f"{blk}.mlp.c_fc")
            row(sch, f"{blk}.mlp.c_proj", sp)
            enter(sch, f"{blk}.mlp", sp)
            if sp:  # replicated parameters see a slice of the sequence: sum their gradients
                for part in ("ln_1", "ln_2", "attn.c_proj", "mlp.c_proj"):
                    replicated(sch, f"{blk}.{part}")
        if sp:
            sch["transformer.drop"].sync(mode="fwd_post", sync_op_or_fn="scatter", dim=1)
            sch["transformer.ln_f"].sync(mode="fwd_post", sync_op_or_fn="all_gather", dim=1)
            replicated(sch, "transformer.ln_f")
        # wte and lm_head share one weight: sharding it once shards both, and they stay tied.
        sch["transformer.wte"].shard("weight", axis=0)
        sch["transformer.wte"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        sch["lm_head"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        sch["lm_head"].sync(mode="fwd_post", sync_op_or_fn="all_gather", dim=-1)
    if k.fuse_ops:
        for blk in layers:
            fuse_bias_gelu(sch, f"{blk}.mlp.c_fc", f"{blk}.mlp.act")
    apply_shared_knobs(sch, k, layers, "lm_head", shift=True)
