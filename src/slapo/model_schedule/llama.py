"""Llama, and the families sharing its layout: Mistral, Qwen2 and Qwen3 (dense)."""

from __future__ import annotations

from ..schedule import Schedule
from .helpers import (
    apply_shared_knobs,
    blocks,
    column,
    enter,
    per_head_norms,
    replicated,
    require,
    row,
    tp_size,
)
from .knobs import Knobs
from .registry import register_schedule


@register_schedule("llama", "mistral", "qwen2", "qwen3")
def llama(sch: Schedule, k: Knobs) -> None:
    """The Llama plan (``LlamaForCausalLM`` and look-alikes); K/V heads must divide by TP size."""
    layers = blocks(sch, "model.layers")
    require(not k.sequence_parallel, "sequence_parallel is implemented for gpt2 only so far")
    require(
        not k.fuse_ops,
        "fuse_ops: llama has nothing to fuse (its MLP is SiLU-gated and "
        "bias-free, its residuals carry no bias)",
    )
    if k.tensor_parallel:
        world = tp_size(sch)
        for heads in ("num_attention_heads", "num_key_value_heads"):
            count = getattr(sch.mod.config, heads)
            require(
                count % world == 0,
                f"tensor parallelism over {world} ranks would split a head: config.{heads} = "
                f"{count} does not divide by {world}; use a group size that divides it",
            )
        for blk in layers:
            for proj in ("q_proj", "k_proj", "v_proj"):  # Qwen2 gives these a bias
                column(sch, f"{blk}.self_attn.{proj}")
            row(sch, f"{blk}.self_attn.o_proj")
            for norm in per_head_norms(sch, f"{blk}.self_attn"):  # Qwen3's q_norm, k_norm
                replicated(sch, norm)  # sees this rank's heads: sum its gradient
            enter(sch, f"{blk}.self_attn")
            for proj in ("gate_proj", "up_proj"):
                column(sch, f"{blk}.mlp.{proj}")
            row(sch, f"{blk}.mlp.down_proj")
            enter(sch, f"{blk}.mlp")
    apply_shared_knobs(sch, k, layers, "lm_head", shift=True)
