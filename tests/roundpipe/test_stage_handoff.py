"""One device: a forward stage's output stays on the device for the next stage (no round trip
over the link), and a backward stage's first input goes ahead while the stage before it
computes. Both keep RoundPipe equal to plain PyTorch, even where a layer changes its input in
place."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import DoublesInPlace, assert_close
from torch import nn

import roundpipe
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe.runtime import run as run_module


def _model(n: int = 5, width: int = 12) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[DoublesInPlace(width) for _ in range(n)])


def _one_layer_stages(n: int) -> ModelExecutePlan:
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(i, i + 1) for i in range(n)]
    plan.bwd_plan = [range(i, i + 1) for i in reversed(range(n))]
    return plan


@pytest.mark.parametrize("link", [None, 50.0], ids=["no-link", "link"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_handed_off_inputs_changed_in_place_keep_gradients_exact(link, grain):
    roundpipe.init_devices(num_virtual=1, link_gbps=link)
    ref = _model()
    model = RoundPipe(
        copy.deepcopy(ref),
        pin_model="off",
        model_run_config=RoundPipeRunConfig(
            num_microbatch=3, recompute_grain=grain, execute_plan=_one_layer_stages(5)
        ),
    )
    torch.manual_seed(1)
    x, y = torch.randn(6, 12), torch.randn(6, 12)
    want = sum(nn.functional.mse_loss(ref(xb), yb) / 3 for xb, yb in zip(x.chunk(3), y.chunk(3)))
    want.backward()
    loss = model.forward_backward(
        (x,), label=y, loss_fn=lambda out, lab: nn.functional.mse_loss(out, lab) / 3
    )
    model.synchronize()
    assert_close(loss, want.detach(), "loss")
    for (name, p), q in zip(model.model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, name)
    roundpipe.init_devices(num_virtual=1)


@pytest.mark.parametrize("ndev", [1, 2])
def test_only_one_device_skips_the_stage_input_uploads(monkeypatch, ndev):
    roundpipe.init_devices(num_virtual=ndev)
    uploads: list[int] = []
    real = run_module.async_h2d
    monkeypatch.setattr(
        run_module, "async_h2d", lambda dev, leaves, *a: uploads.append(1) or real(dev, leaves, *a)
    )
    model = RoundPipe(
        _model(),
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=_one_layer_stages(5)),
    )
    with torch.no_grad():
        model(torch.randn(4, 12))
    model.synchronize()
    # 5 forward stages x 2 microbatches: one device uploads only the first stage's inputs
    assert len(uploads) == (2 if ndev == 1 else 10)
    roundpipe.init_devices(num_virtual=1)
