"""Slapo on a real GPU: attention kernels, the CUDA RNG tracker under recompute, ready
schedules, tensor parallelism and checkpoints on NCCL (world size 1), the RoundPipe target."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hf_models
import slapo
from slapo.op.attention import attention


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("impl", ["sdpa", "flash"])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_attention_kernels_match_eager(dtype, impl, kv_heads):
    """The fused kernels in half precision are as accurate as eager attention in half
    precision, both measured against eager attention in float32."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, 64, 32, device="cuda")
    k = torch.randn(2, kv_heads, 64, 32, device="cuda")
    v = torch.randn(2, kv_heads, 64, 32, device="cuda")
    grad_out = torch.randn(2, 8, 64, 32, device="cuda")

    def run(which: str, dt: torch.dtype) -> list[torch.Tensor]:
        leaves = [t.detach().to(dt).requires_grad_(True) for t in (q, k, v)]
        out = attention(*leaves, is_causal=True, impl=which)
        out.backward(grad_out.to(dt))
        return [out.detach().float()] + [t.grad.float() for t in leaves]

    exact = run("eager", torch.float32)
    eager_half, fused = run("eager", dtype), run(impl, dtype)
    for name, ref, e, f in zip(("out", "dq", "dk", "dv"), exact, eager_half, fused):
        eager_err = (e - ref).abs().max().item()
        fused_err = (f - ref).abs().max().item()
        # half-precision rounding bounds both; the fused kernel may not be much worse
        assert fused_err <= 2 * eager_err + 1e-3, (name, fused_err, eager_err)
        torch.testing.assert_close(f, ref, rtol=2e-2, atol=2e-2, msg=lambda m, n=name: f"{n}: {m}")


def test_flash_refuses_float32_with_a_clear_error():
    q = torch.randn(1, 2, 8, 16, device="cuda")
    with pytest.raises(slapo.SlapoError, match="fp16/bf16"):
        attention(q, q, q, impl="flash")


def _dropout_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.5), nn.Linear(64, 1)).cuda()


def _fork_and_maybe_checkpoint(net: nn.Module, checkpoint: bool) -> nn.Module:
    sch = slapo.create_schedule(net)
    sch["1"].fork_rng()
    if checkpoint:
        sch.checkpoint()
    model, _ = slapo.build(sch, init_weights=False)
    return model


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    slapo.set_random_seed(7, tp_rank=0)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_cuda_rng_tracker_replays_dropout_under_recompute():
    x = torch.randn(16, 32, device="cuda", requires_grad=True)
    assert slapo.get_cuda_rng_tracker().device_type == "cuda"
    ref_loss, ref_grads = _step(_fork_and_maybe_checkpoint(_dropout_net(), False), x)
    loss, grads = _step(_fork_and_maybe_checkpoint(_dropout_net(), True), x)
    # the recompute reruns the same kernels on the same operands with the forward's RNG state
    assert torch.equal(loss, ref_loss)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)
    # and the forked state really is another stream than the default generator's
    torch.manual_seed(7)
    plain = _dropout_net()
    plain_loss = plain(x).square().mean().detach()
    assert not torch.equal(plain_loss, ref_loss)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_ready_schedule_on_cuda_matches_eager(family):
    ref = hf_models.make(family, dropout=0.0).cuda()
    model = copy.deepcopy(ref)
    sch = slapo.model_schedule.apply_schedule(model, ckpt_ratio=1.0, attn_op="sdpa")
    built, _ = slapo.build(sch, init_weights=False)
    data = {k: v.cuda() for k, v in hf_models.batch().items()}
    # SDPA against the model's own attention, and recompute: float32 tolerance
    hf_models.assert_same_step(ref, built, data)


@pytest.fixture
def nccl_world_of_one(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_tensor_parallel_and_checkpoints_on_nccl(nccl_world_of_one, tmp_path):
    ref = hf_models.make("llama", dropout=0.0).cuda()
    model = copy.deepcopy(ref)
    sch = slapo.model_schedule.apply_schedule(model, group=nccl_world_of_one, ckpt_ratio=0.5)
    built, opt = slapo.build(sch, init_weights=False, optimizer=torch.optim.AdamW)
    data = {k: v.cuda() for k, v in hf_models.batch().items()}
    hf_models.assert_same_step(ref, built, data)
    opt.step()
    slapo.save_checkpoint(built, tmp_path / "ckpt", opt)
    fresh = hf_models.make("llama", dropout=0.0, seed=1).cuda()
    slapo.load_checkpoint(fresh, tmp_path / "ckpt")
    for (name, p), q in zip(built.named_parameters(), fresh.parameters()):
        assert torch.equal(p.detach(), q.detach()), f"{name} did not round-trip"


def test_roundpipe_target_trains_a_transformers_model_on_the_gpu():
    import roundpipe

    roundpipe.init_devices(backend="cuda")
    ref = hf_models.make("llama", dropout=0.0, layers=4)
    sch = slapo.create_schedule(copy.deepcopy(ref))
    model, opt = slapo.build(sch, target="roundpipe", num_microbatch=2, optimizer=torch.optim.AdamW)
    ref_opt = torch.optim.AdamW(ref.parameters())
    losses, ref_losses = [], []
    data = hf_models.batch()
    for _ in range(4):
        losses.append(slapo.train_step(model, data).detach().cpu())
        opt.step()
        opt.zero_grad()
        ref_loss = ref(**data).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.detach())
    # GPU kernels against CPU kernels, two microbatches against one batch
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-4)
    assert losses[-1] < losses[0]
