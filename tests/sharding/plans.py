"""Megatron-style tensor-parallel schedules of GPT-2, Llama and BERT, written with shard/sync.

Attention heads: transformers 5 reshapes q/k/v with ``view(..., -1, head_dim)``, so sharded
projections give each rank ``heads / world`` heads by themselves. Attributes that still hold the
global sizes are set on the attention module through the schedule (GPT-2's ``split_size``, which
splits its fused q/k/v output, must be; ``num_heads``/``embed_dim`` and BERT's
``num_attention_heads``/``all_head_size`` are kept consistent for readers).
"""

from __future__ import annotations

SP_GATHER = {"sync_op_or_fn": "all_gather", "dim": 1, "bwd": "reduce_scatter"}


def _column(sch, path, bias=True, fused=1):
    sch[path].shard(
        "weight", axis=0 if "Linear" in type(sch[path].mod).__name__ else 1, fused=fused
    )
    if bias:
        sch[path].shard("bias", axis=0, fused=fused)


def _row(sch, path, sequence_parallel=False):
    sch[path].shard("weight", axis=1 if "Linear" in type(sch[path].mod).__name__ else 0)
    if sequence_parallel:
        sch[path].sync(mode="fwd_post", sync_op_or_fn="reduce_scatter", dim=1)
    else:
        sch[path].sync(mode="fwd_post", sync_op_or_fn="all_reduce")


def _enter(sch, path, sequence_parallel=False):
    """The start of a tensor-parallel region: all-reduce of the input gradient (or SP gather)."""
    if sequence_parallel:
        sch[path].sync(mode="fwd_pre", **SP_GATHER)
    else:
        sch[path].sync(mode="bwd_post", sync_op_or_fn="all_reduce")


def gpt2(sch, world, vocab_parallel=True, pad=False, gather_logits=True, sequence_parallel=False):
    for name in sch["transformer.h"].child:
        blk = f"transformer.h.{name}"
        _column(sch, f"{blk}.attn.c_attn", fused=3)
        _row(sch, f"{blk}.attn.c_proj", sequence_parallel)
        _enter(sch, f"{blk}.attn", sequence_parallel)
        attn = sch[f"{blk}.attn"].mod
        attn.split_size //= world
        attn.embed_dim //= world
        attn.num_heads //= world
        _column(sch, f"{blk}.mlp.c_fc")
        _row(sch, f"{blk}.mlp.c_proj", sequence_parallel)
        _enter(sch, f"{blk}.mlp", sequence_parallel)
    if sequence_parallel:
        from slapo.sharding import mark_sequence_parallel

        sch["transformer.drop"].sync(mode="fwd_post", sync_op_or_fn="scatter", dim=1)
        sch["transformer.ln_f"].sync(mode="fwd_post", sync_op_or_fn="all_gather", dim=1)
        for name in sch["transformer.h"].child:
            for norm in ("ln_1", "ln_2", "attn.c_proj", "mlp.c_proj"):  # + row-parallel biases
                mark_sequence_parallel(sch[f"transformer.h.{name}.{norm}"].mod)
        mark_sequence_parallel(sch["transformer.ln_f"].mod)
    if vocab_parallel:
        # wte and lm_head share one weight: sharding it once shards both, and they stay tied.
        sch["transformer.wte"].shard("weight", axis=0, pad=pad)
        sch["transformer.wte"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        sch["lm_head"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        if gather_logits:
            sch["lm_head"].sync(mode="fwd_post", sync_op_or_fn="all_gather", dim=-1)


def llama(sch, world):
    for name in sch["model.layers"].child:
        blk = f"model.layers.{name}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            _column(sch, f"{blk}.self_attn.{proj}", bias=False)
        _row(sch, f"{blk}.self_attn.o_proj")
        _enter(sch, f"{blk}.self_attn")  # main input arrives as hidden_states=
        for proj in ("gate_proj", "up_proj"):
            _column(sch, f"{blk}.mlp.{proj}", bias=False)
        _row(sch, f"{blk}.mlp.down_proj")
        _enter(sch, f"{blk}.mlp")


def bert(sch, world):
    for name in sch["bert.encoder.layer"].child:
        blk = f"bert.encoder.layer.{name}"
        for proj in ("query", "key", "value"):
            _column(sch, f"{blk}.attention.self.{proj}")
        _row(sch, f"{blk}.attention.output.dense")
        _enter(sch, f"{blk}.attention.self")
        attn = sch[f"{blk}.attention.self"].mod
        attn.num_attention_heads //= world
        attn.all_head_size //= world
        _column(sch, f"{blk}.intermediate.dense")
        _row(sch, f"{blk}.output.dense")
        _enter(sch, f"{blk}.intermediate")


PLANS = {"gpt2": gpt2, "llama": llama, "bert": bert}
