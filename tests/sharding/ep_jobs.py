"""Expert-parallel worker jobs (spawned gloo processes); each groups many checks into one job.

The oracle is computed in every worker by one process on the global batch, without any
communication; the expert-parallel model then runs on this rank's slice of it.

DeepSeek-V3 (routed experts, replicated shared experts, group-limited sigmoid routing with a
correction bias) has no router aux loss: its balance comes from the correction bias, a buffer no
gradient trains, and the model returns no ``aux_loss``. It runs the global-batch check only.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch import nn

from dist_utils import run_checks
from slapo.checkpoints import MARKER, load_checkpoint, save_checkpoint
from slapo.sharding import get_shard_spec
from slapo.sharding.expert_dispatch import count_dispatched, dispatch_combine
from slapo.sharding.expert_parallel import (
    ExpertParallelError,
    all_reduce_replicated_grads,
    expert_parallel,
    is_expert_parameter,
)

VOCAB, SEQ, PER_RANK = 96, 12, 2
EXPERTS, TOP_K = 8, 2


def tiny(family: str, aux: bool = True, experts: int = EXPERTS) -> nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts_per_tok=TOP_K,
        output_router_logits=aux,
        router_aux_loss_coef=0.5,  # large, so a wrong aux loss cannot hide in the tolerance
        use_cache=False,
    )
    torch.manual_seed(0)
    if family == "deepseek_v3":
        return _tiny_deepseek_v3(experts)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=48, moe_intermediate_size=16, num_experts=experts, **common
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif family == "qwen2_moe":  # routed experts plus a replicated shared expert
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=experts,
            **common,
        )
        model = transformers.Qwen2MoeForCausalLM(cfg)
    elif family == "gpt_oss":  # transposed expert weights with biases, clamped SwiGLU
        cfg = transformers.GptOssConfig(
            intermediate_size=16, num_local_experts=experts, sliding_window=8, **common
        )
        model = transformers.GptOssForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(
            intermediate_size=16, num_local_experts=experts, router_jitter_noise=0.0, **common
        )
        model = transformers.MixtralForCausalLM(cfg)
    model.train()
    return model


def _tiny_deepseek_v3(experts: int) -> nn.Module:
    """Three layers, the first dense (``first_k_dense_replace``): two MoE layers, as the others.
    4 expert groups of 2, the top 2 groups eligible; a nonzero correction bias so that it takes
    part in the choice (transformers initialises it to zero)."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=experts,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=TOP_K,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        use_cache=False,
    )
    model = transformers.DeepseekV3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(5)
    for mod in model.modules():
        bias = getattr(mod, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=g) * 0.05)
    model.train()
    return model


def global_batch(world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(123)
    return torch.randint(1, VOCAB, (world * PER_RANK, SEQ), generator=g)


def my_slice(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x[rank * PER_RANK : (rank + 1) * PER_RANK]


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_model(family: str, aux: bool, group: dist.ProcessGroup | None = None) -> None:
    """Loss (averaged over the group's ranks) and every gradient equal one process's.

    With the aux loss the data-parallel objective is the mean of per-batch losses (the router's
    load-balancing loss is not additive over batches), so the one-process reference averages the
    losses of the ranks' slices. Without it, the reference is one forward on the concatenated batch.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ids = global_batch(world)
    ref = tiny(family, aux)
    model = copy.deepcopy(ref)
    if aux:
        ref_loss = (
            sum(ref(input_ids=my_slice(ids, r), labels=my_slice(ids, r)).loss for r in range(world))
            / world
        )
    else:
        ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref_grads = grads(ref)

    expert_parallel(model, group)
    mine = my_slice(ids, rank)
    with count_dispatched() as sent:
        loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    all_reduce_replicated_grads(model, group)
    assert sent["calls"] == 2 and sent["rows_to_peers"] > 0, sent  # two MoE layers

    avg = loss.detach().clone()
    dist.all_reduce(avg, group=group)
    torch.testing.assert_close(avg / world, ref_loss.detach())
    names = set()
    for name, p in model.named_parameters():
        expected = ref_grads[name]
        if is_expert_parameter(model, name):
            per = EXPERTS // world
            expected = expected[rank * per : (rank + 1) * per]
            assert p.shape[0] == per, (name, p.shape)
            spec = get_shard_spec(p)  # what the checkpoints store it by
            assert spec is not None and spec.full_shape == ref_grads[name].shape, (name, spec)
            assert (spec.axis, spec.world, spec.rank) == (0, world, rank), spec
        assert p.grad is not None, f"no gradient for {name}"
        torch.testing.assert_close(p.grad, expected, msg=lambda m, n=name: f"{n}: {m}")
        names.add(name)
    assert names == set(ref_grads), set(ref_grads) ^ names


def check_model_moves_routed_rows(
    family: str, rank: int, world: int, dtype: torch.dtype = torch.float32
) -> None:
    """The rows sent to other ranks are exactly the (token, expert) pairs routed off-rank, and
    their bytes are those pairs x hidden size x the element size of ``dtype``."""
    model = expert_parallel(tiny(family).to(dtype))
    routed: list[torch.Tensor] = []
    for mod in model.modules():
        # Qwen3MoeTopKRouter, MixtralTopKRouter, DeepseekV3TopkRouter: (logits, weights, ids)
        if type(mod).__name__.lower().endswith("topkrouter"):
            mod.register_forward_hook(lambda _m, _i, out: routed.append(out[2]))
    mine = my_slice(global_batch(world), rank)
    with count_dispatched() as sent:
        model(input_ids=mine, labels=mine).loss.backward()
    per = EXPERTS // world
    off_rank = sum(int(((ids // per) != rank).sum()) for ids in routed)
    assert len(routed) == 2 and off_rank > 0
    assert sent["rows_to_peers"] == off_rank, (sent, off_rank)
    assert sent["elements_to_peers"] == off_rank * 32, sent
    item = torch.empty((), dtype=dtype).element_size()
    assert sent["bytes_to_peers"] == off_rank * 32 * item, (sent, off_rank, dtype)
    assert sent["rows_kept"] + off_rank == mine.numel() * TOP_K * 2, sent


def check_dispatcher(rank: int, world: int) -> None:
    """dispatch_combine alone: output, token gradients and expert-weight gradients equal a dense
    one-process computation over every rank's tokens; the row counts match the routing."""
    g = torch.Generator().manual_seed(7)
    n, h = 5, 6
    x_all = torch.randn(world, n, h, generator=g)
    ids_all = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(world * n)])
    ids_all = ids_all.view(world, n, TOP_K)
    w_all = torch.rand(world, n, TOP_K, generator=g)
    cot = torch.randn(world, n, h, generator=g)
    weight = torch.randn(EXPERTS, h, h, generator=g)

    ref_w = weight.clone().requires_grad_()
    ref_x = x_all.clone().requires_grad_()
    per_pair = torch.einsum("rnh,rnkoh->rnko", ref_x, ref_w[ids_all])
    ref_out = (per_pair * w_all[..., None]).sum(2)
    (ref_out * cot).sum().backward()

    per = EXPERTS // world
    local_w = weight[rank * per : (rank + 1) * per].clone().requires_grad_()
    x = x_all[rank].clone().requires_grad_()
    with count_dispatched() as sent:
        out = dispatch_combine(
            x, ids_all[rank], w_all[rank], EXPERTS, lambda j, rows: rows @ local_w[j].T
        )
    (out * cot[rank]).sum().backward()
    torch.testing.assert_close(out, ref_out[rank].detach())
    torch.testing.assert_close(x.grad, ref_x.grad[rank])
    torch.testing.assert_close(local_w.grad, ref_w.grad[rank * per : (rank + 1) * per])
    off_rank = int(((ids_all[rank] // per) != rank).sum())
    assert sent["rows_to_peers"] == off_rank > 0 and sent["elements_to_peers"] == off_rank * h
    assert sent["bytes_to_peers"] == off_rank * h * x.element_size(), sent


def check_errors(rank: int, world: int) -> None:
    odd = world * 2 + 2 if world == 4 else 3  # 10 experts over 4 ranks, 3 over 2
    model = tiny("qwen3_moe", experts=odd)
    try:
        expert_parallel(model)
    except ExpertParallelError as err:
        msg = str(err)
        assert "model.layers.0.mlp.experts" in msg and f"{odd} experts" in msg, msg
        assert f"group size {world}" in msg, msg
    else:
        raise AssertionError("no error for an indivisible expert count")
    # Nothing was changed: validation runs before any block is replaced.
    assert type(model.model.layers[1].mlp.experts).__name__ == "Qwen3MoeExperts"

    class OddExperts(nn.Module):
        pass

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = OddExperts()

    wrapper = nn.Sequential(nn.Linear(2, 2), Block())
    try:
        expert_parallel(wrapper)
    except ExpertParallelError as err:
        assert '"1.experts"' in str(err) and "OddExperts" in str(err), str(err)
    else:
        raise AssertionError("no error for an unsupported MoE block")

    model = expert_parallel(tiny("mixtral"))
    try:
        expert_parallel(model)
    except ExpertParallelError as err:
        assert "already expert-parallel" in str(err), str(err)
    else:
        raise AssertionError("no error when applied twice")


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _momentum(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: opt.state[p]["momentum_buffer"] for n, p in model.named_parameters()}


def check_checkpoint(family: str, rank: int, world: int, root: str) -> None:
    """Checkpoints stay layout-free under EP: after the same SGD step (the reference on the
    global batch), an EP model's checkpoint holds every tensor once at its full shape under the
    user's names and loads into a full model, weights and momentum equal to the reference's; the
    reference's (full) checkpoint loads into a fresh EP model, each rank getting its experts."""
    ids = global_batch(world)
    ref = tiny(family, aux=False)
    model = expert_parallel(copy.deepcopy(ref))
    ref_opt, opt = _sgd(ref), _sgd(model)
    ref(input_ids=ids, labels=ids).loss.backward()
    ref_opt.step()
    mine = my_slice(ids, rank)
    model(input_ids=mine, labels=mine).loss.backward()
    all_reduce_replicated_grads(model)
    opt.step()
    ref_state, ref_mom = ref.state_dict(), _momentum(ref_opt, ref)

    # EP -> one process: the experts stored whole, under the user's names only.
    ep_dir = Path(root) / f"ep{world}-{family}"
    save_checkpoint(model, ep_dir, opt)
    marker = json.loads((ep_dir / MARKER).read_text())
    assert marker["model_keys"] == list(ref_state), set(marker["model_keys"]) ^ set(ref_state)
    full = tiny(family, aux=False)
    full_opt = _sgd(full)
    load_checkpoint(full, ep_dir, full_opt)  # checks every full shape against the files
    torch.testing.assert_close(full.state_dict(), ref_state)
    torch.testing.assert_close(_momentum(full_opt, full), ref_mom)

    # one process -> EP: every rank writes part of the full model's files; each keeps its slice.
    full_dir = Path(root) / f"full{world}-{family}"
    save_checkpoint(ref, full_dir, ref_opt)
    fresh = expert_parallel(tiny(family, aux=False))
    fresh_opt = _sgd(fresh)
    load_checkpoint(fresh, full_dir, fresh_opt)
    per = EXPERTS // world
    mom = _momentum(fresh_opt, fresh)
    experts = 0
    for name, p in fresh.named_parameters():
        want, want_mom = ref_state[name], ref_mom[name]
        if is_expert_parameter(fresh, name):
            want, want_mom = (t[rank * per : (rank + 1) * per] for t in (want, want_mom))
            experts += 1
        torch.testing.assert_close(p.detach(), want, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(mom[name], want_mom, msg=lambda m, n=name: f"{n}: {m}")
    assert experts > 0
    torch.testing.assert_close(fresh.state_dict(), model.state_dict())  # both routes agree


def ep_job(rank: int, world: int, root: str) -> dict[str, str | None]:
    checks = {
        "dispatcher": lambda: check_dispatcher(rank, world),
        "errors": lambda: check_errors(rank, world),
    }
    for family in ("qwen3_moe", "mixtral"):
        checks[f"{family}_aux"] = lambda f=family: check_model(f, aux=True)
        checks[f"{family}_global"] = lambda f=family: check_model(f, aux=False)
        checks[f"{family}_moves"] = lambda f=family: check_model_moves_routed_rows(f, rank, world)
    checks["qwen2_moe_aux"] = lambda: check_model("qwen2_moe", aux=True)
    checks["gpt_oss_aux"] = lambda: check_model("gpt_oss", aux=True)
    checks["deepseek_v3_global"] = lambda: check_model("deepseek_v3", aux=False)
    checks["deepseek_v3_moves_bf16"] = lambda: check_model_moves_routed_rows(
        "deepseek_v3", rank, world, torch.bfloat16
    )
    checks["deepseek_v3_checkpoint"] = lambda: check_checkpoint("deepseek_v3", rank, world, root)
    checks["gpt_oss_checkpoint"] = lambda: check_checkpoint("gpt_oss", rank, world, root)
    if world == 4:
        # EP inside a data-parallel world: two ep groups of 2, ranks {0, 1} and {2, 3}.
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pair = pairs[rank // 2]
        checks["subgroup_qwen3_moe"] = lambda: check_model("qwen3_moe", aux=True, group=pair)
    return run_checks(checks)
