"""User guide: Custom Execution Plans, Logging and Profiling, Saving Data for Recomputation.

The pages' plans, timer output and recompute API on CPU virtual devices (instead of CUDA GPUs)
with random weights and synthetic batches; every run is checked against plain PyTorch (loss and
every gradient, float32, rtol 1e-5 / atol 1e-6).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from guide_reference import assert_grads, assert_params, split_mb
from torch import nn

import roundpipe
from roundpipe import (
    ModelExecutePlan,
    RoundPipe,
    RoundPipeRunConfig,
    doing_recompute,
    get_recompute_data,
    save_for_recompute,
)
from roundpipe.runtime.context import RecomputeDataError
from roundpipe.runtime.plan import InvalidPlanError
from roundpipe.timer import ModelTimer


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def _stack(n_layers: int, width: int = 8, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(width) for _ in range(n_layers)])


def _plan(fwd: list[range], bwd: list[range]) -> ModelExecutePlan:
    plan = ModelExecutePlan()
    plan.fwd_plan = fwd
    plan.bwd_plan = bwd
    return plan


def _one_layer_stages(hi: int, lo: int = 0) -> list[range]:
    return [range(i, i + 1) for i in reversed(range(lo, hi))]


def _mse(n_mb: int):
    return lambda out, y: nn.functional.mse_loss(out, y) / n_mb


def _plain_fused(net: nn.Module, x: torch.Tensor, y: torch.Tensor, n_mb: int) -> torch.Tensor:
    total = torch.zeros(())
    for xb, yb in zip(split_mb(x, n_mb), split_mb(y, n_mb)):
        loss = _mse(n_mb)(net(xb), yb)
        loss.backward()
        total = total + loss.detach()
    return total


def _check_fused_plan(net: nn.Module, plan: ModelExecutePlan, n_mb: int = 2) -> None:
    """forward_backward with ``plan`` equals plain PyTorch (loss, every gradient)."""
    ref = copy.deepcopy(net)
    model = RoundPipe(net, pin_model="off")
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    cfg = RoundPipeRunConfig(num_microbatch=n_mb, execute_plan=plan)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=_mse(n_mb), run_config=cfg)
    assert_params([loss], [_plain_fused(ref, x, y, n_mb)], f"loss with {plan}")
    assert_grads(net, ref, f"gradients with {plan}")


def _check_forward_plan(net: nn.Module, plan: ModelExecutePlan, n_mb: int = 2) -> None:
    """forward() + loss.backward() with ``plan`` equals plain PyTorch."""
    ref = copy.deepcopy(net)
    model = RoundPipe(net, pin_model="off")
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    cfg = RoundPipeRunConfig(num_microbatch=n_mb, execute_plan=plan)
    loss = nn.functional.mse_loss(model(x, roundpipe_run_config=cfg), y)
    loss.backward()
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    assert_params([loss], [ref_loss], f"loss with {plan}")
    assert_grads(net, ref, f"gradients with {plan}")


# -- Custom Execution Plans ---------------------------------------------------------------------
def test_page_plans_run_like_pytorch(ndev):
    """The page's 4-layer plans: for forward() (every layer forward, 1-layer backward stages) and
    for forward_backward() (fwd_plan stops before the fused last layer); the overview's 12-layer
    asymmetric plan; the 25-layer manual plan of 'How to Build a Plan'."""
    _check_forward_plan(_stack(4), _plan([range(0, 2), range(2, 4)], _one_layer_stages(4)))
    _check_fused_plan(_stack(4), _plan([range(0, 3)], _one_layer_stages(4)))
    overview = _plan([range(i, i + 3) for i in range(0, 12, 3)], _one_layer_stages(12))
    _check_forward_plan(_stack(12), overview)
    fwd = [range(0, 7), range(7, 14), range(14, 21), range(21, 24)]
    bwd = [range(24, 25)] + [range(i, i + 2) for i in range(22, -1, -2)]
    _check_fused_plan(_stack(25), _plan(fwd, bwd))
    # the fused stage may be the whole model: fwd_plan is then empty
    _check_fused_plan(_stack(3), _plan([], [range(0, 3)]))


def test_auto_plan_after_timing(two_devices):
    """plan = ModelExecutePlan.auto("fused", model) after a few timed iterations, passed in the
    run config; joint plans for two models; both spellings check as valid."""
    net = _stack(6)
    ref = copy.deepcopy(net)
    model = RoundPipe(net, pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(3):
        model.forward_backward(input_args=(x,), label=y, loss_fn=_mse(2))
        _plain_fused(ref, x, y, 2)
    plan = ModelExecutePlan.auto("fused", model)
    plan.check_valid(6, "fused")
    loss = model.forward_backward(
        input_args=(x,),
        label=y,
        loss_fn=_mse(2),
        run_config=RoundPipeRunConfig(execute_plan=plan),
    )
    assert_params([loss], [_plain_fused(ref, x, y, 2)], "loss with the auto plan")
    assert_grads(net, ref, "gradients with the auto plan")
    other = RoundPipe(_stack(3, seed=1), pin_model="off")
    plan1, plan2 = ModelExecutePlan.auto("fused", model, other)
    plan1.check_valid(6, "fused")
    plan2.check_valid(3, "fused")


@pytest.mark.parametrize(
    "fwd, bwd, run_type, match",
    [
        ([range(0, 2), range(3, 4)], _one_layer_stages(4), "train", "fwd_plan does not cover"),
        ([range(0, 3), range(2, 4)], _one_layer_stages(4), "train", "fwd_plan does not cover"),
        ([range(2, 4), range(0, 2)], _one_layer_stages(4), "train", "fwd_plan does not cover"),
        ([range(0, 4)], [range(0, 2), range(2, 4)], "train", "bwd_plan does not cover"),
        ([range(0, 4)], [range(0, 2)], "train", "bwd_plan covers layers 0..1"),
        ([range(0, 3)], _one_layer_stages(4), "train", "forward_backward\\(\\) only"),
        ([range(0, 2)], _one_layer_stages(4), "fused", "last fwd_plan layer \\+ 1"),
        ([range(0, 4)], _one_layer_stages(4), "fused", "last fwd_plan layer \\+ 1"),
        ([range(0, 3)], [range(3, 4), range(0, 3)], "infer", "fwd_plan covers layers 0..2"),
        ([range(0, 2), range(2, 2)], _one_layer_stages(4), "train", "non-empty ranges"),
        ((range(0, 4),), _one_layer_stages(4), "train", "list of ranges"),
    ],
)
def test_invalid_plans_are_typed_errors_before_running(two_devices, fwd, bwd, run_type, match):
    """The page's validation rules: a plan breaking one raises InvalidPlanError (a ValueError)
    naming the rule, from the call, before any stage runs."""
    net = _stack(4)
    before = [p.detach().clone() for p in net.parameters()]
    model = RoundPipe(net, pin_model="off")
    cfg = RoundPipeRunConfig(num_microbatch=2, execute_plan=_plan(fwd, bwd))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(InvalidPlanError, match=match) as info:
        if run_type == "fused":
            model.forward_backward(input_args=(x,), label=y, loss_fn=_mse(2), run_config=cfg)
        elif run_type == "train":
            model(x, roundpipe_run_config=cfg).sum().backward()
        else:
            with torch.no_grad():
                model(x, roundpipe_run_config=cfg)
    assert isinstance(info.value, ValueError)
    assert all(p.grad is None for p in net.parameters())
    assert_params(net.parameters(), before, "parameters untouched")


# -- Logging and Profiling ----------------------------------------------------------------------
_LINE = re.compile(
    r"^Layer (\d+) (fwd|re |bwd)  new record: (\d+\.\d{3}) ms  new estimate: (\d+\.\d{3}) ms$"
)


def test_verbose_timer_prints_one_line_per_layer_and_pass(two_devices, capsys, monkeypatch):
    """ModelTimer.VERBOSE = True prints to stderr, after each iteration, 'Layer N fwd|re|bwd  new
    record: X ms  new estimate: Y ms' for every layer and pass it ran (the warm-up iteration is
    dropped); the estimates are the planner's. The run itself still equals plain PyTorch."""
    monkeypatch.setattr(ModelTimer, "VERBOSE", True)
    net = _stack(4)
    ref = copy.deepcopy(net)
    plan = _plan([range(0, 3)], _one_layer_stages(4))  # layer 3 only in the fused stage
    model = RoundPipe(
        net,
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
    )
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    per_iteration = []
    for _ in range(3):
        model.forward_backward(input_args=(x,), label=y, loss_fn=_mse(2))
        out = capsys.readouterr()
        assert out.out == ""
        per_iteration.append(out.err.splitlines())
        _plain_fused(ref, x, y, 2)
    assert_grads(net, ref, "gradients of three iterations")
    assert per_iteration[0] == []  # warm-up
    expected = [(i, k) for i in range(4) for k in ("fwd", "re", "bwd") if (i, k) != (3, "fwd")]
    for lines in per_iteration[1:]:
        parsed = [_LINE.match(line) for line in lines]
        assert all(parsed), lines
        assert [(int(m[1]), m[2].strip()) for m in parsed] == expected
    last = {(int(m[1]), m[2].strip()): float(m[4]) for m in map(_LINE.match, per_iteration[-1])}
    source, fwd, bwd = model.model_timer.get_estimate("fused")
    assert source == "time"
    for i in range(4):
        if i < 3:
            assert last[(i, "fwd")] == pytest.approx(fwd[i], abs=6e-4)
        assert last[(i, "re")] + last[(i, "bwd")] == pytest.approx(bwd[i], abs=1.2e-3)

    # forward() then loss.backward(): forward lines after the forward, the rest after backward
    plan = _plan([range(0, 2), range(2, 4)], _one_layer_stages(4))
    out = model(x, roundpipe_run_config=RoundPipeRunConfig(execute_plan=plan))
    after_forward = capsys.readouterr().err.splitlines()
    out.sum().backward()
    after_backward = capsys.readouterr().err.splitlines()
    assert [_LINE.match(line)[2] for line in after_forward] == ["fwd"] * 4
    assert [(int(m[1]), m[2].strip()) for m in map(_LINE.match, after_backward)] == [
        (i, k) for i in range(4) for k in ("re", "bwd")
    ]


def test_timer_is_quiet_by_default(two_devices, capsys):
    model = RoundPipe(_stack(2), pin_model="off")
    for _ in range(3):
        model.forward_backward(input_args=(torch.randn(3, 8),), loss_fn=lambda o, _: o.sum())
    out = capsys.readouterr()
    assert out.out == "" and "Layer" not in out.err


# -- Saving Data for Recomputation --------------------------------------------------------------
class MoELayer(nn.Module):
    """The page's MoE layer with routing replay. The routing also favours two experts chosen by
    how many forwards this layer has run (a standalone buffer): a recompute that routed again
    would pick other experts, so matching plain PyTorch needs the replay."""

    replays = 0

    def __init__(self, num_experts: int, hidden_size: int, expert_size: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts)
        self.experts = nn.ModuleList(
            [nn.Linear(hidden_size, expert_size) for _ in range(num_experts)]
        )
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if doing_recompute():
            (selected_experts,) = get_recompute_data()
            MoELayer.replays += 1
        else:
            self.calls.add_(1)
            experts = torch.arange(self.gate.out_features, device=x.device)
            favoured = (experts - self.calls) % self.gate.out_features < 2  # moves per call
            gate_logits = self.gate(x) + 10.0 * favoured
            routing_weights = torch.softmax(gate_logits, dim=-1)
            selected_experts = torch.topk(routing_weights, k=2, dim=-1).indices
            save_for_recompute(selected_experts)
        weights = torch.softmax(self.gate(x), dim=-1).gather(-1, selected_experts)
        output = torch.zeros(x.shape[0], self.experts[0].out_features, device=x.device)
        for slot in range(selected_experts.shape[-1]):
            for e, expert in enumerate(self.experts):
                rows = selected_experts[:, slot] == e
                output = output + rows.unsqueeze(-1) * weights[:, slot : slot + 1] * expert(x)
        return output


class SparseLayer(nn.Module):
    """The page's sparse layer: the nonzero() indices are saved, not recomputed."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if doing_recompute():
            (index,) = get_recompute_data()
        else:
            index = torch.nonzero(x.sum(-1) > 0).squeeze(-1)
            save_for_recompute(index)
        out = x.clone()
        out[index] = self.lin(x[index])
        return out


class ConditionalLayer(nn.Module):
    """The page's conditional layer: a Python bool decided in forward is replayed."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.branch_a = nn.Linear(width, width)
        self.branch_b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if doing_recompute():
            (use_branch_a,) = get_recompute_data()
        else:
            use_branch_a = (x.mean() > 0).item()
            save_for_recompute(use_branch_a)
        return self.branch_a(x) if use_branch_a else self.branch_b(x)


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_recompute_data_examples_train_like_pytorch(two_devices, grain):
    """The page's three layers in backward stages that recompute them: the saved data is handed
    back, so loss, every gradient and the layers' buffers equal plain PyTorch."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(8, 8),
        MoELayer(4, 8, 8),
        SparseLayer(8),
        ConditionalLayer(8),
        nn.Linear(8, 8),
    )
    ref = copy.deepcopy(net)
    plan = _plan([range(0, 2), range(2, 4)], _one_layer_stages(5))
    model = RoundPipe(
        net,
        pin_model="off",
        model_run_config=RoundPipeRunConfig(
            num_microbatch=2, execute_plan=plan, recompute_grain=grain
        ),
    )
    MoELayer.replays = 0
    for _ in range(2):
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=_mse(2))
        assert_params([loss], [_plain_fused(ref, x, y, 2)], "loss")
    assert MoELayer.replays == 4  # 2 iterations x 2 microbatches
    assert_grads(net, ref, "gradients")
    assert_params(net.buffers(), ref.buffers(), "buffers")


def test_recompute_api_rules(two_devices):
    """get_recompute_data() outside a recompute raises AssertionError (as published; also a
    RuntimeError); save_for_recompute is a no-op without gradients, refuses tensors requiring
    grad and a second call in one forward."""
    assert doing_recompute() is False
    with pytest.raises(AssertionError, match="outside a RoundPipe recompute"):
        get_recompute_data()
    with pytest.raises(RuntimeError):
        get_recompute_data()
    assert issubclass(RecomputeDataError, AssertionError)

    class Saves(nn.Module):
        def __init__(self, what: str) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.what = what

        def forward(self, x):
            out = self.lin(x)
            if self.what == "grad":
                save_for_recompute(self.lin.weight)  # requires grad (forward runs no_grad)
            elif self.what == "twice":
                save_for_recompute(out.detach())
                save_for_recompute(out.detach())
            else:
                save_for_recompute(out.detach())
            return out

    plan = _plan([range(0, 1)], _one_layer_stages(2))
    cfg = RoundPipeRunConfig(num_microbatch=1, execute_plan=plan)
    with torch.no_grad():  # inference: nothing is saved, nothing is refused
        RoundPipe(nn.Sequential(Saves("twice"), nn.Linear(4, 4)), pin_model="off")(
            torch.randn(2, 4), roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1)
        )
    for what, error in (("grad", ValueError), ("twice", RuntimeError)):
        model = RoundPipe(nn.Sequential(Saves(what), nn.Linear(4, 4)), pin_model="off")
        with pytest.raises(error, match="save_for_recompute"):
            model.forward_backward(
                input_args=(torch.randn(2, 4),), loss_fn=lambda o, _: o.sum(), run_config=cfg
            )
    assert roundpipe.get_num_devices() == 2


@pytest.mark.parametrize("name", ["runtime.context", "runtime.timer", "runtime.plan"])
def test_docstring_examples(two_devices, name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"roundpipe.{name}"))
    assert result.attempted > 0 and result.failed == 0
