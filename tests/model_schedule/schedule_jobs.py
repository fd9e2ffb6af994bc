"""Tensor-parallel checks of the ready schedules, run in spawned gloo workers (one job, many
checks): the single-process loss and gradients are the oracle."""

from __future__ import annotations

import copy

import torch
import transformers
from torch import nn

import hf_models
import slapo
from dist_utils import run_checks
from slapo.model_schedule import apply_schedule
from slapo.sharding import allreduce_sequence_parallel_grads, get_shard_spec

TOL = {"rtol": 1e-4, "atol": 1e-5}


def qwen2(dropout: float = 0.0) -> nn.Module:
    """Llama's layout with biased q/k/v projections."""
    cfg = transformers.Qwen2Config(
        vocab_size=hf_models.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attention_dropout=dropout,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(cfg)


def make(family: str) -> nn.Module:
    if family == "qwen2":
        torch.manual_seed(0)
        return qwen2().train()
    return hf_models.make(family, dropout=0.0)


def check_tp(family: str, **knobs) -> None:
    """Loss equal to one process; each rank's gradients are its slices of the full ones."""
    ref = make(family)
    model = copy.deepcopy(ref)
    sch = apply_schedule(model, group=torch.distributed.group.WORLD, **knobs)
    model, _ = slapo.build(sch, init_weights=False)
    data = hf_models.batch()
    ref_loss, ref_grads = hf_models.run(ref, data)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = model(**data).loss
    loss.backward()
    if knobs.get("sequence_parallel"):  # summed inside backward: nothing left to sum by hand
        assert allreduce_sequence_parallel_grads(model) == 0
    torch.testing.assert_close(loss.detach(), ref_loss, **TOL)
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{family}: no gradient for {name}"
        spec = get_shard_spec(param)
        want = ref_grads[name] if spec is None else spec.local_slice(ref_grads[name])
        torch.testing.assert_close(param.grad, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    sharded = sum(get_shard_spec(p) is not None for p in model.parameters())
    assert sharded > 0, f"{family}: nothing was sharded"


def tp_job(rank: int, world: int) -> dict[str, str | None]:
    torch.set_num_threads(1)
    checks = {
        f"{fam}": (lambda fam=fam: check_tp(fam)) for fam in ("gpt2", "llama", "bert", "opt", "t5")
    }
    checks["qwen2 (biased q/k/v)"] = lambda: check_tp("qwen2")
    checks["gpt2 sequence parallel"] = lambda: check_tp("gpt2", sequence_parallel=True)
    checks["llama sequence parallel + ckpt"] = lambda: check_tp(
        "llama", sequence_parallel=True, ckpt_ratio=1.0
    )
    checks["llama tp + ckpt + sdpa + fused loss"] = lambda: check_tp(
        "llama", ckpt_ratio=1.0, attn_op="sdpa", fused_loss=True
    )
    checks["bert tp + fuse_ops + ckpt"] = lambda: check_tp("bert", fuse_ops=True, ckpt_ratio=0.5)
    checks["t5 tp + ckpt + eager attention"] = lambda: check_tp(
        "t5", ckpt_ratio=1.0, attn_op="eager"
    )
    checks["llama heads that do not divide: clear error"] = check_head_split_error
    return run_checks(checks)


def check_head_split_error() -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=hf_models.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    try:
        apply_schedule(model, group=torch.distributed.group.WORLD)
    except slapo.SlapoError as err:
        assert "num_key_value_heads = 1 does not divide by 2" in str(err), err
    else:
        raise AssertionError("a K/V head split over 2 ranks was not refused")
