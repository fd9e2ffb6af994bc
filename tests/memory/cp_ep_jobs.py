"""Models, batches and the measured real step of the context- and expert-parallel estimate tests.

The measurement, independent of the planner: after one real step of the rank, its parameter,
gradient and optimizer-state storages, plus the most bytes saved for backward alive at once
(``slapo.memory.LiveSaved``: every tensor autograd saves, counted when packed, uncounted when
freed; parameters excluded).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn

from slapo.memory import LiveSaved

VOCAB, SEQ, BATCH = 96, 64, 2
EXPERTS, TOP_K = 8, 2


def llama(meta: bool = False) -> nn.Module:
    """A tiny Llama with grouped-query attention (no dropout: the same bytes every run)."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        attention_dropout=0.0, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return transformers.LlamaForCausalLM(cfg).train()


def qwen3_moe(meta: bool = False) -> nn.Module:
    """A tiny Qwen3-MoE: 8 experts, top-2, transformers' fused experts."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return transformers.Qwen3MoeForCausalLM(cfg).train()


MODELS = {"llama": llama, "qwen3_moe": qwen3_moe}


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _bytes(tensors: Any) -> int:
    return sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )


def measure(model: nn.Module, inputs: dict[str, Any], after_backward: Any = None) -> dict[str, int]:
    """One real AdamW step of ``model`` on ``inputs``: the rank's bytes by part."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    live = LiveSaved(skip={p.untyped_storage().data_ptr() for p in model.parameters()})
    with live:
        model(**inputs).loss.backward()
    if after_backward is not None:
        after_backward()
    opt.step()
    real = {
        "params": _bytes(model.parameters()),
        "grads": _bytes(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer_state": _bytes(
            v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ),
        "activations": live.peak,
    }
    real["peak"] = sum(real.values()) + _bytes(model.buffers())
    return real


def cp_step(rank: int, world: int) -> dict[str, int]:
    """A cp rank of the tiny Llama: attention over the world, this rank's part of the batch."""
    from slapo.sharding.context_parallel import all_reduce_grads, context_parallel

    model = llama()
    context = context_parallel(model)
    return measure(model, context.model_batch(batch()), lambda: all_reduce_grads(model))


def ep_step(rank: int, world: int) -> dict[str, Any]:
    """An ep rank of the tiny Qwen3-MoE on its own batch: the experts split over the world."""
    from slapo.sharding.expert_dispatch import count_dispatched
    from slapo.sharding.expert_grads import reduce_expert_grads
    from slapo.sharding.expert_parallel import expert_parallel

    model = qwen3_moe()
    expert_parallel(model)
    reduce_expert_grads(model, None, average_over=world)
    with count_dispatched() as sent:
        real = measure(model, batch(seed=rank))
    assert dist.get_world_size() == world
    return {**real, "rows": sent["rows_kept"] + sent["rows_to_peers"]}
