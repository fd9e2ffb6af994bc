"""One GPU: forward stage outputs handed to the next stage on the device (no download and
upload between them) keep RoundPipe equal to plain PyTorch, even where a layer changes its input
in place while the host copy for the recompute is still being downloaded."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import DoublesInPlace
from torch import nn

from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_handoff_on_the_gpu_equals_pytorch(gpu, grain):
    torch.manual_seed(0)
    ref = nn.Sequential(*[DoublesInPlace(256) for _ in range(5)])
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(i, i + 1) for i in range(5)]
    plan.bwd_plan = [range(i, i + 1) for i in reversed(range(5))]
    model = RoundPipe(
        copy.deepcopy(ref),
        pin_model="alloc",
        model_run_config=RoundPipeRunConfig(
            num_microbatch=3, recompute_grain=grain, execute_plan=plan
        ),
    )
    x, y = torch.randn(96, 256), torch.randn(96, 256)
    want = sum(nn.functional.mse_loss(ref(xb), yb) / 3 for xb, yb in zip(x.chunk(3), y.chunk(3)))
    want.backward()
    loss = model.forward_backward(
        (x,), label=y, loss_fn=lambda out, lab: nn.functional.mse_loss(out, lab) / 3
    )
    model.synchronize()
    torch.testing.assert_close(loss.cpu(), want.detach(), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.grad.cpu(), q.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
