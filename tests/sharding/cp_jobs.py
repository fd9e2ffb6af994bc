"""Worker functions of the context-parallel tests, run in spawned gloo processes."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import transformers
from torch import nn

import hf_models
from dist_utils import run_checks
from slapo.sharding.context_attention import PATH_CALLS
from slapo.sharding.context_parallel import all_reduce_grads, context_parallel

SEQ = 16  # divides by 2 * 4


def qwen2(**config: object) -> nn.Module:
    cfg = transformers.Qwen2Config(
        vocab_size=hf_models.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,  # multi-query: the extreme of grouped-query attention
        max_position_embeddings=32,
        attention_dropout=0.0,
        use_cache=False,
        **config,
    )
    return transformers.Qwen2ForCausalLM(cfg)


def llama(num_key_value_heads: int = 2, **config: object) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=hf_models.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_key_value_heads,  # 2: grouped-query attention
        max_position_embeddings=32,
        attention_dropout=0.0,
        use_cache=False,
        **config,
    )
    return transformers.LlamaForCausalLM(cfg)


def make(family: str, **config: object) -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":  # learned absolute positions: position_ids must be the global ones
        return hf_models.make("gpt2", dropout=0.0, **config)
    return (qwen2 if family == "qwen2" else llama)(**config).train()


def batch(padded: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, hf_models.VOCAB, (2, SEQ), generator=g)
    data = {"input_ids": ids, "labels": ids.clone()}
    if padded:  # left padding of different lengths: later queries must not see the padded keys
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        mask[1, :6] = 0
        data["attention_mask"] = mask
        data["labels"] = ids.masked_fill(mask == 0, -100)
    return data


def reference(model: nn.Module, data: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and every gradient of one process on the whole sequence (transformers' own loss)."""
    model.zero_grad(set_to_none=True)
    loss = model(**data).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def cp_step(model: nn.Module, data: dict, group=None, sum_grads: bool = True):
    cp = context_parallel(model, group)
    model.zero_grad(set_to_none=True)
    local = cp.shard_batch(data)
    labels = local.pop("shift_labels")
    loss = cp.loss(model(**local).logits, labels)
    loss.backward()
    if sum_grads:
        all_reduce_grads(model, group)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def check_equal(family: str, padded: bool = False, group=None, **config: object) -> None:
    ref = make(family, **config)
    model = copy.deepcopy(ref)
    data = batch(padded)
    ref_loss, ref_grads = reference(ref, data)
    before = PATH_CALLS.copy()
    loss, grads = cp_step(model, data, group)
    # which attention ran: dense (masked) SDPA with padding, the mask-free kernels without
    ran = {path: PATH_CALLS[path] - before[path] for path in ("mask_free", "dense")}
    layers = model.config.num_hidden_layers
    assert ran == ({"mask_free": 0, "dense": layers} if padded else
                   {"mask_free": layers, "dense": 0}), ran  # fmt: skip
    torch.testing.assert_close(loss, ref_loss)
    assert set(grads) == set(ref_grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=lambda m, n=name: f"grad of {n}: {m}")


def check_sensitive() -> None:
    """The oracle can fail: skipping the gradient sum, or attending only to local keys, differs."""
    ref = make("llama")
    data = batch()
    ref_loss, ref_grads = reference(ref, data)
    _, grads = cp_step(copy.deepcopy(ref), data, sum_grads=False)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(grads[q], ref_grads[q]), "unsummed gradients matched the reference"
    # plain sdpa on the local tokens (no gathered keys): a different loss
    cp = context_parallel(copy.deepcopy(ref))
    local = cp.shard_batch(data)
    labels = local.pop("shift_labels")
    plain = copy.deepcopy(ref)
    plain.set_attn_implementation("sdpa")
    loss = cp.loss(plain(**local).logits, labels)
    assert not torch.allclose(loss, ref_loss), "local-only attention matched the reference"


def check_gather_round_trip(rank: int, world: int) -> None:
    cp = context_parallel(make("llama"))
    full = torch.arange(2 * 3 * SEQ, dtype=torch.float32).view(2, SEQ, 3)
    local = cp.split(full)
    torch.testing.assert_close(cp.gather(local), full, rtol=0, atol=0)
    assert cp.positions(SEQ).tolist() == cp.shard_batch(batch())["position_ids"][0].tolist()


def check_subgroup(rank: int, world: int) -> None:
    """cp over a sub-group (ranks {0,1} and {2,3}) as a mesh dimension would give."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    check_equal("llama", group=groups[rank // 2])


def cp_job(rank: int, world: int) -> dict[str, str | None]:
    checks = {
        "llama": lambda: check_equal("llama"),
        "llama_mha": lambda: check_equal("llama", num_key_value_heads=4),
        "llama_padded": lambda: check_equal("llama", padded=True),
        "qwen2": lambda: check_equal("qwen2"),
        "sensitive": check_sensitive,
        "gather_round_trip": lambda: check_gather_round_trip(rank, world),
    }
    if world == 2:
        checks["gpt2"] = lambda: check_equal("gpt2")
    if world == 4:  # fewer checks: four processes share the test machine's cores
        del checks["llama_mha"], checks["sensitive"]
        checks["subgroup"] = lambda: check_subgroup(rank, world)
    return run_checks(checks)
