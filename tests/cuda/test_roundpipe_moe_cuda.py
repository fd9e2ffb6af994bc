"""Mixture-of-experts and generic presets on the GPU: a tiny Qwen3-MoE (its preset) and a tiny
Mixtral (the generic preset, its router's score rule found in forward) with the router loss, in 2
microbatches on the real device, against the plain model on the CPU (loss, router loss, every
gradient)."""

from __future__ import annotations

import copy

import pytest
import torch

from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe

zoo = pytest.importorskip("slapo.testing")


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_moe_router_loss_and_grads_on_the_gpu_equal_pytorch(gpu, model_type, grain):
    ref = zoo.tiny_model(model_type)
    hf = copy.deepcopy(ref)
    rp = wrap_model_to_roundpipe(
        hf,
        use_sequential_preset=True,
        pin_model="alloc",
        model_run_config=RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain),
    )
    batch = zoo.sample_batch(ref, batch=4, seq=12, seed=3)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][3, 9:] = 0
    want = ref(**batch, output_router_logits=True)
    want.loss.backward()
    got = rp(**batch, output_router_logits=True, return_logits=False)
    got.loss.backward()
    rp.synchronize()
    # GPU kernels sum in another order than the CPU's: float32 tolerances, not bit-identity
    torch.testing.assert_close(got.loss.cpu(), want.loss.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.aux_loss.cpu(), want.aux_loss.detach(), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(hf.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(
            p.grad.cpu(), q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
