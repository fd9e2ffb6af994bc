"""T5 (encoder-decoder): Megatron tensor parallelism of self/cross attention and the MLP; the
relative position bias is sharded over the heads."""

from __future__ import annotations

from ..schedule import Schedule
from .helpers import apply_shared_knobs, blocks, column, divide_attrs, enter, row
from .knobs import Knobs
from .registry import register_schedule


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
        for blk in layers:
            for layer in sch[f"{blk}.layer"].child.values():
                kind = next(iter(layer.child))  # SelfAttention, EncDecAttention or DenseReluDense
                path = f"{layer.path}.{kind}"
                if kind == "DenseReluDense":
                    column(sch, f"{path}.wi")
                    row(sch, f"{path}.wo")
                    enter(sch, path)
                    continue
                for proj in ("q", "k", "v"):
                    column(sch, f"{path}.{proj}")
                row(sch, f"{path}.o")
                enter(sch, path)  # the gradient of hidden_states (into q)
                if kind == "EncDecAttention":  # and of the encoder states, into k and v
                    enter(sch, f"{path}.k")
                    enter(sch, f"{path}.v")
                divide_attrs(sch, path, "n_heads", "inner_dim")
                if "relative_attention_bias" in sch[path].child:
                    sch[f"{path}.relative_attention_bias"].shard("weight", axis=1)  # heads
    # The blocks that compute the relative position bias (an embedding) and hand it on: inductor
    # (torch 2.13, CPU) mis-indexes its backward there when the block keeps its dropout.
    bias_blocks = [
        blk
        for blk in layers
        if hasattr(sch[f"{blk}.layer.0"].mod.SelfAttention, "relative_attention_bias")
    ]
    apply_shared_knobs(sch, k, layers, "lm_head", shift=False, recompute_dropout_in=bias_blocks)
