"""``recompute_grain="layer"``: each layer recomputed once from its input saved in forward,
equal to stage grain and to plain PyTorch, with one layer's activations on the device at a time."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close
from torch import nn

from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig, device

N_LAYERS = 6
WIDTH = 32
HIDDEN = 128


class _Counted(nn.Module):
    """An MLP block counting its calls per layer index (a class-level table: the device
    copies of the layer share it)."""

    calls: dict[int, int] = {}

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Counted.calls[self.index] = _Counted.calls.get(self.index, 0) + 1
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[_Counted(i) for i in range(N_LAYERS)])


def _plan(fused: bool) -> ModelExecutePlan:
    """Multi-layer stages: forward 0-2 | 3-5; backward 3-5 | 0-2 (fused: 3-5 is the fused stage)."""
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 3), range(3, N_LAYERS)]
    plan.bwd_plan = [range(3, N_LAYERS), range(0, 3)]
    plan.check_valid(N_LAYERS, "fused" if fused else "train")
    return plan


def _wrap(net: nn.Module, grain: str, fused: bool, n_mb: int = 3) -> RoundPipe:
    cfg = RoundPipeRunConfig(num_microbatch=n_mb, recompute_grain=grain, execute_plan=_plan(fused))
    return RoundPipe(net, pin_model="off", model_run_config=cfg)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out**2).mean()


def _run(model: RoundPipe, x: torch.Tensor, fused: bool, n_mb: int = 3) -> torch.Tensor:
    if fused:  # each microbatch's share of the mean over the batch
        return model.forward_backward((x,), loss_fn=lambda out, _: _loss(out) / n_mb)
    loss = _loss(model(x))
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "autograd"])
def test_layer_grain_equals_stage_grain_and_pytorch(two_devices, fused):
    ref = _net()
    x = torch.randn(6, WIDTH)
    ref_loss = _loss(ref(x))
    ref_loss.backward()
    for grain in ("stage", "layer"):
        net = copy.deepcopy(ref)
        net.zero_grad()
        loss = _run(_wrap(net, grain, fused), x, fused)
        assert_close(loss, ref_loss.detach(), f"loss ({grain})")
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, f"grad {name} ({grain})")


def test_input_gradients_with_layer_grain(two_devices):
    ref = _net()
    x = torch.randn(6, WIDTH, requires_grad=True)
    _loss(ref(x)).backward()
    model = _wrap(copy.deepcopy(ref), "layer", fused=False)
    x2 = x.detach().clone().requires_grad_(True)
    _loss(model(x2)).backward()
    assert_close(x2.grad, x.grad, "input gradient")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "autograd"])
def test_each_layer_recomputed_once(two_devices, fused):
    n_mb = 3
    model = _wrap(_net(), "layer", fused, n_mb)
    _Counted.calls.clear()
    _run(model, torch.randn(6, WIDTH), fused, n_mb)
    fused_layers = set(_plan(fused).bwd_plan[0]) if fused else set()
    want = {i: n_mb * (1 if i in fused_layers else 2) for i in range(N_LAYERS)}
    assert _Counted.calls == want  # forward + one recompute per microbatch (fused: forward only)


def _activation_peak(grain: str, tokens: int) -> int:
    """The largest accounted device peak over one non-fused step with one stage of all layers,
    minus the parameter and gradient bytes that stage accounts at either grain."""
    net = _net()
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, N_LAYERS)]
    plan.bwd_plan = [range(0, N_LAYERS)]
    cfg = RoundPipeRunConfig(num_microbatch=1, recompute_grain=grain, execute_plan=plan)
    model = RoundPipe(net, pin_model="off", model_run_config=cfg)
    devs = device.get_devices()
    for d in devs:
        d.memory.reset_peak()
    _loss(model(torch.randn(tokens, WIDTH))).backward()
    device.wait_devices_idle(timeout=30)
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    return max(d.memory.peak for d in devs) - 2 * param_bytes


def test_layer_grain_device_peak_is_one_layer(two_devices, monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_ACCOUNT_ACTIVATIONS", "1")
    tokens = 512
    stage = _activation_peak("stage", tokens)
    layer = _activation_peak("layer", tokens)
    hidden_act = tokens * HIDDEN * 4  # one (tokens x HIDDEN) float32 tensor
    # a layer saves up(x) and gelu(up(x)) for backward and allocates the gradients of both:
    # ~4 hidden-sized tensors; the stage grain keeps the saved ones of all six layers at once
    assert layer <= 5 * hidden_act, (layer, stage)
    assert stage >= 2 * (N_LAYERS - 1) * hidden_act, (layer, stage)
    assert layer * 2 < stage, (layer, stage)
