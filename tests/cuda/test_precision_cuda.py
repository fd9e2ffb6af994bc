"""Mixed precision and placement on a real GPU: the CUDA twins of ``tests/targets/
test_precision.py`` (autocast on the eager target, FSDP2's policy over NCCL, RoundPipe's bf16
model streamed from the host, fp16's loss scaler) and the main job on ``--device cuda``.

bf16 comparisons use the CPU suite's tolerance (``jobs_precision.BF16_REL``: 2% of each
gradient's norm).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hf_models
import slapo
from slapo.model_schedule import apply_schedule
from slapo.targets.mixed_precision import grad_scaler_of

sys.path.append(str(Path(__file__).resolve().parents[1] / "targets"))
from jobs_precision import assert_close_rel  # noqa: E402  (the path above)


def _batch(device: str = "cuda") -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in hf_models.batch(seed=3).items()}


def _reference(model, autocast: bool):
    model = model.cuda()
    if autocast:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**_batch()).loss
    else:
        model = model.to(torch.bfloat16)
        loss = model(**_batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_eager_bf16_on_cuda_schedule_equals_unscheduled():
    model = hf_models.make("llama", dropout=0.0)
    ref_loss, ref_grads = _reference(copy.deepcopy(model), autocast=True)
    sch = apply_schedule(model, ckpt_ratio=1.0, attn_op="sdpa")
    built, opt = slapo.build(sch, device="cuda", precision="bf16", optimizer=torch.optim.AdamW)
    loss = slapo.train_step(built, _batch())
    assert_close_rel(loss, ref_loss, "loss")
    for name, p in built.named_parameters():
        assert p.is_cuda and p.dtype == p.grad.dtype == torch.float32, name
        assert_close_rel(p.grad, ref_grads[name], f"gradient of {name}")
    opt.step()
    assert all(v.is_cuda for s in opt.state.values() for v in s.values() if v.dim())


def test_fsdp_bf16_on_nccl_equals_the_bf16_model():
    slapo.env.setup(0, 1, "nccl")
    try:
        model = hf_models.make("llama", dropout=0.0)
        ref_loss, ref_grads = _reference(copy.deepcopy(model), autocast=False)
        built, opt = slapo.build(
            slapo.create_schedule(model), target="fsdp", device="cuda", precision="bf16",
            optimizer=torch.optim.AdamW,
        )  # fmt: skip
        loss = slapo.train_step(built, _batch())
        assert_close_rel(loss, ref_loss, "fsdp loss")
        for name, p in built.named_parameters():
            grad = p.grad.full_tensor()
            assert grad.dtype == torch.float32 and grad.is_cuda, name
            assert_close_rel(grad, ref_grads[name], f"fsdp gradient of {name}")
        opt.step()
    finally:
        dist.destroy_process_group()


def test_fp16_overflow_on_cuda_skips_the_step():
    built, opt = slapo.build(
        slapo.create_schedule(hf_models.make("llama", dropout=0.0)), device="cuda",
        precision="fp16", optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
    )  # fmt: skip
    scaler = grad_scaler_of(built)
    scale = scaler.get_scale()
    before = {n: p.detach().clone() for n, p in built.named_parameters()}
    slapo.train_step(built, _batch())
    next(built.parameters()).grad.view(-1)[0] = float("inf")
    opt.step()
    assert scaler.get_scale() == scale / 2
    assert all(torch.equal(p, before[n]) for n, p in built.named_parameters())


def test_roundpipe_bf16_streams_from_the_host(gpu):
    model = hf_models.make("llama", dropout=0.0)
    ref_loss, ref_grads = _reference(copy.deepcopy(model), autocast=False)
    built, opt = slapo.build(
        slapo.create_schedule(model), target="roundpipe", precision="bf16",
        optimizer=torch.optim.AdamW,
    )  # fmt: skip
    loss = slapo.train_step(built, _batch("cpu"))
    assert_close_rel(loss, ref_loss.cpu(), "roundpipe loss")
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.bfloat16, name
        assert_close_rel(p.grad, ref_grads[name].cpu(), f"roundpipe gradient of {name}")
    opt.step()


@pytest.mark.parametrize("target", ["eager", "roundpipe"])
def test_main_job_on_cuda_in_bf16(target):
    """``slapo train --device cuda --precision bf16``: trains on the GPU, the curve within 0.05
    of fp32's, and the estimate within 25% of the allocator's peak."""
    from slapo.train import TrainConfig, train

    common = dict(target=target, device="cuda", steps=20, baseline_steps=0, progress=False,
                  sample=False, compile_model=False)  # fmt: skip
    fp32 = train(TrainConfig(precision="fp32", **common))
    bf16 = train(TrainConfig(precision="bf16", **common))
    assert bf16["device"].startswith("cuda") and bf16["precision"] == "bf16"
    gaps = [abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"])]
    assert max(gaps) < 0.05, max(gaps)
    if target == "eager" and bf16["estimated_peak_mb"]:
        assert abs(bf16["estimated_peak_mb"] / bf16["peak_memory_mb"] - 1) < 0.25
