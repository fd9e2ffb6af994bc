"""BERT and RoBERTa (masked LM): Megatron tensor parallelism, fused bias+GELU and
bias+dropout+residual."""

from __future__ import annotations

from ..schedule import Schedule
from .fusion import fuse_bias_dropout_residual, fuse_bias_gelu
from .helpers import apply_shared_knobs, blocks, require
from .knobs import Knobs
from .schedule_registry import register_schedule
from .tp_plan import TPPlan, apply_tp_plan


def bert_plan(prefix: str) -> TPPlan:
    """The plan of a BERT encoder under ``prefix`` ("bert.", "roberta." or ""): the self
    attention's q/k/v and the intermediate projection split by columns, the two output
    projections by rows; the self attention keeps its global head count, divided.

    Example:
        >>> bert_plan("bert.").styles["bert.encoder.layer.*.intermediate.dense"]
        Colwise()
    """
    layer = f"{prefix}encoder.layer.*"
    return TPPlan(
        {
            f"{layer}.attention.self.query": "colwise",
            f"{layer}.attention.self.key": "colwise",
            f"{layer}.attention.self.value": "colwise",
            f"{layer}.attention.output.dense": "rowwise",
            f"{layer}.intermediate.dense": "colwise",
            f"{layer}.output.dense": "rowwise",
        },
        divide={f"{layer}.attention.self": ("num_attention_heads", "all_head_size")},
    )


@register_schedule(
    "bert",
    "roberta",
    unsupported={
        "sequence_parallel": "its norms sit inside the output modules, beside the row-parallel "
        "projections, where the sequence would have to be split",
    },
)
def bert(sch: Schedule, k: Knobs) -> None:
    """The BERT plan (``BertForMaskedLM``, ``RobertaForMaskedLM``, or the bare encoder)."""
    base = next(p for p in ("bert", "roberta", "") if p in sch.child or p == "")
    pre = f"{base}." if base else ""
    layers = blocks(sch, f"{pre}encoder.layer")
    if k.tensor_parallel:
        apply_tp_plan(sch, bert_plan(pre), layers)
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
