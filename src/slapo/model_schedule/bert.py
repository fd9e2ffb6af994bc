"""BERT and RoBERTa (masked LM): Megatron tensor parallelism, fused bias+GELU and
bias+dropout+residual."""

from __future__ import annotations

from ..schedule import Schedule
from .fusion import fuse_bias_dropout_residual, fuse_bias_gelu
from .helpers import apply_shared_knobs, blocks, column, divide_attrs, enter, require, row
from .knobs import Knobs
from .registry import register_schedule


@register_schedule("bert", "roberta")
def bert(sch: Schedule, k: Knobs) -> None:
    """The BERT plan (``BertForMaskedLM``, ``RobertaForMaskedLM``, or the bare encoder)."""
    base = next(p for p in ("bert", "roberta", "") if p in sch.child or p == "")
    pre = f"{base}." if base else ""
    layers = blocks(sch, f"{pre}encoder.layer")
    require(not k.sequence_parallel, "sequence_parallel is implemented for gpt2 only so far")
    if k.tensor_parallel:
        for blk in layers:
            for proj in ("query", "key", "value"):
                column(sch, f"{blk}.attention.self.{proj}")
            row(sch, f"{blk}.attention.output.dense")
            enter(sch, f"{blk}.attention.self")
            divide_attrs(sch, f"{blk}.attention.self", "num_attention_heads", "all_head_size")
            column(sch, f"{blk}.intermediate.dense")
            row(sch, f"{blk}.output.dense")
            enter(sch, f"{blk}.intermediate")
    if k.fuse_ops:
        for blk in layers:
            fuse_bias_gelu(
                sch, f"{blk}.intermediate.dense", f"{blk}.intermediate.intermediate_act_fn"
            )
            if not k.tensor_parallel:  # a row-parallel bias is added after the all-reduce
                fuse_bias_dropout_residual(sch, f"{blk}.attention.output")
                fuse_bias_dropout_residual(sch, f"{blk}.output")
    if k.fused_loss:
        require("cls" in sch.child, "fused_loss needs a masked-LM head (cls.predictions)")
    apply_shared_knobs(sch, k, layers, "cls.predictions.decoder", shift=False)
