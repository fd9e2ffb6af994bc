"""RoundPipeOptimizer: the ordinary PyTorch loop over RoundPipe's step protocol."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from helpers import assert_close, mlp
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig, optim_stream
from roundpipe.optim import RoundPipeOptimizer


def _model(net: nn.Module) -> RoundPipe:
    return RoundPipe(net, pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=2))


class _HeldOptimizerThread:
    """Blocks the optimizer thread until exit, so a launched step has surely not run yet."""

    def __enter__(self) -> _HeldOptimizerThread:
        self.release = threading.Event()
        optim_stream.launch_optim_kernel(self.release.wait, 30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()


def _sgd_reference(net0: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float) -> nn.Module:
    ref = copy.deepcopy(net0)
    nn.functional.mse_loss(ref(x), y).backward()
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    return ref


@pytest.mark.timeout(60)
def test_async_zero_grad_leaves_the_pending_step_its_gradients(two_devices):
    """zero_grad() right after an asynchronous step() must not clear the gradients the optimizer
    thread has yet to take (the ordinary loop calls it at once)."""
    net0 = mlp(3)
    net = copy.deepcopy(net0)
    model = _model(net)
    opt = RoundPipeOptimizer(
        model, torch.optim.SGD(model.optim_parameters(), lr=0.1), is_async=True
    )
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    nn.functional.mse_loss(model(x), y).backward()
    with _HeldOptimizerThread():
        opt.step()
        opt.zero_grad()
    model.synchronize()
    for p, q in zip(net.parameters(), _sgd_reference(net0, x, y, 0.1).parameters()):
        assert_close(p, q, "parameters after the held step")
    assert all(p.grad is None for p in net.parameters())
    assert all(p.grad is None for p in model.optim_parameters())  # cleared after the step


@pytest.mark.timeout(60)
def test_async_step_uses_the_lr_in_force_when_it_was_called(two_devices):
    """A scheduler changing lr right after step() must not reach that step, even when the
    optimizer thread runs it later."""
    net0 = mlp(3)
    net = copy.deepcopy(net0)
    model = _model(net)
    opt = RoundPipeOptimizer(
        model, torch.optim.SGD(model.optim_parameters(), lr=0.1), is_async=True
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 100.0 if step else 1.0)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    nn.functional.mse_loss(model(x), y).backward()
    with _HeldOptimizerThread():
        opt.step()
        opt.zero_grad()
        sched.step()  # lr 0.1 -> 10 for the NEXT step
    model.synchronize()
    assert opt.param_groups[0]["lr"] == pytest.approx(10.0)
    for p, q in zip(net.parameters(), _sgd_reference(net0, x, y, 0.1).parameters()):
        assert_close(p, q, "parameters after a step with lr 0.1")
    assert opt.state_dict()["param_groups"][0]["lr"] == pytest.approx(10.0)


def test_hooks_closure_and_repr(two_devices):
    model = _model(mlp(3))
    opt = RoundPipeOptimizer(model, torch.optim.SGD(model.optim_parameters(), lr=0.1))
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    x, y = torch.randn(4, 8), torch.randn(4, 1)

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert calls == ["pre", "post"] and loss.requires_grad
    assert "SGD" in repr(opt) and "is_async=False" in repr(opt)
    assert isinstance(opt, torch.optim.Optimizer)


def test_bad_arguments_are_clear_errors(two_devices):
    model = _model(mlp(3))
    with pytest.raises(ValueError, match=r"optim_parameters\(\), not model.parameters\(\)"):
        RoundPipeOptimizer(model, torch.optim.SGD(nn.Module.parameters(model), lr=0.1))
    with pytest.raises(TypeError, match="RoundPipe model"):
        RoundPipeOptimizer(mlp(3), torch.optim.SGD(mlp(3).parameters(), lr=0.1))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        RoundPipeOptimizer(model, "adam")  # type: ignore[arg-type]
    opt = RoundPipeOptimizer(model, torch.optim.SGD(model.optim_parameters(), lr=0.1))
    with pytest.raises(ValueError, match="add_param_group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1)).backward()
    with pytest.raises(RuntimeError, match="not inside model.step"):
        model.step(opt.step, is_async=False)  # the wrapper runs model.step itself


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_resume_from_state_dicts_continues_the_same_training(two_devices, is_async):
    """load_state_dict on the model refreshes the optimizer copies: otherwise the next step
    would copy the old copies back over the loaded weights."""

    def make(seed):
        model = _model(mlp(3, seed=seed))
        inner = torch.optim.AdamW(model.optim_parameters(), lr=0.05)
        return model, RoundPipeOptimizer(model, inner, is_async=is_async)

    def run(model, opt, data):
        for x, y in data:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        model.synchronize()

    torch.manual_seed(4)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(4)]
    model, opt = make(seed=0)
    run(model, opt, data[:2])
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    run(model, opt, data[2:])
    resumed, resumed_opt = make(seed=1)  # other weights, to be replaced by the checkpoint
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    run(resumed, resumed_opt, data[2:])
    for p, q in zip(resumed.model.parameters(), model.model.parameters()):
        assert_close(p, q, "parameters after resuming")
