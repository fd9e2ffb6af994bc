"""Training on CPU virtual devices equals plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close, delayed_update_reference, mlp, seeded_reference_loss
from torch import nn

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig, save_for_recompute


def _mse_mb(n_mb):
    return lambda out, y: nn.functional.mse_loss(out, y) / n_mb


@pytest.fixture(params=[None, 1.0], ids=["no_link", "link"])
def link(request, ndev):
    """The ``ndev`` CPU virtual devices without, or re-created with, a modelled link (1 GB/s:
    these small layers hold it for microseconds). With the link, copy engines run transfers on
    their own threads: stage uploads are prefetched and gradients land in the background."""
    if request.param is not None:
        roundpipe.init_devices(num_virtual=ndev, link_gbps=request.param)
    return request.param


@pytest.mark.parametrize("mode", ["forward_backward", "autograd"])
def test_sync_training_equals_pytorch(ndev, link, mode):
    ref = mlp(5)
    net = copy.deepcopy(ref)
    model = RoundPipe(net, pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=4))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.optim_parameters(), lr=1e-2)
    torch.manual_seed(1)
    for step in range(4):
        x, y = torch.randn(8, 8), torch.randn(8, 1)
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        if mode == "forward_backward":
            loss = model.forward_backward((x,), label=y, loss_fn=_mse_mb(4))
        else:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        assert_close(loss, ref_loss.detach(), f"loss at step {step}")
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, f"grad {name} at step {step}")
        ref_opt.step()
        ref_opt.zero_grad()
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert_close(p, q, "parameters after training")


def test_input_gradients_flow_to_caller(two_devices):
    ref = mlp(3)
    model = RoundPipe(
        copy.deepcopy(ref), pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=3)
    )
    x = torch.randn(6, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    (model(x) ** 2).sum().backward()
    (ref(x_ref) ** 2).sum().backward()
    assert_close(x.grad, x_ref.grad, "input grad")


def test_chained_models_with_packed_data(two_devices):
    ref = mlp(6)
    a = RoundPipe(
        copy.deepcopy(ref[:5]),
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=2, merge_output=False),
    )
    b = RoundPipe(
        copy.deepcopy(ref[5:]),
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    packed = a(x)
    assert isinstance(packed, roundpipe.RoundPipePackedData) and len(packed) == 2
    loss = b.forward_backward((packed,), label=y, loss_fn=_mse_mb(2))
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "chained loss")
    for p, q in zip(list(a.model.parameters()) + list(b.model.parameters()), ref.parameters()):
        assert_close(p.grad, q.grad, "chained grads")


def test_inference_matches_and_keeps_no_state(ndev):
    ref = mlp(4)
    model = RoundPipe(copy.deepcopy(ref), pin_model="off")
    x = torch.randn(7, 8)
    with torch.no_grad():
        out = model(x)
    assert not out.requires_grad
    assert_close(out, ref(x).detach(), "inference output")


@pytest.mark.parametrize("fixed_plan", [False, True], ids=["auto_plan", "fixed_plan"])
def test_async_training_equals_delayed_update_reference(ndev, link, fixed_plan):
    net0 = mlp(4)
    net = copy.deepcopy(net0)
    plan = None
    if fixed_plan:  # a backward stage shares its device with an earlier forward stage
        plan = roundpipe.ModelExecutePlan()
        plan.fwd_plan = [range(0, 2), range(2, 3), range(3, 7)]
        plan.bwd_plan = [range(3, 7), range(1, 3), range(0, 1)]
    model = RoundPipe(
        net,
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
    )
    opt = torch.optim.Adam(model.optim_parameters(), lr=1e-2)
    torch.manual_seed(3)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(5)]
    # reference: iteration k runs on the optimizer's values after step k-2 (one step stale)
    ref_losses, master, _ = delayed_update_reference(
        net0, data, lambda ps: torch.optim.Adam(ps, lr=1e-2)
    )
    for k, (x, y) in enumerate(data):
        loss = model.forward_backward((x,), label=y, loss_fn=_mse_mb(2))
        assert_close(loss, ref_losses[k], f"async loss at iteration {k}")
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    for p, q in zip(net.parameters(), master.parameters()):
        assert_close(p, q, "parameters after synchronize")
    for p, q in zip(model.optim_parameters(), master.parameters()):
        assert_close(p, q, "optimizer copies")


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "autograd"])
def test_recompute_with_dropout_equals_reference(two_devices, grain, fused):
    ref = mlp(5, dropout=0.3)
    net = copy.deepcopy(ref)
    model = RoundPipe(
        net,
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=3, recompute_grain=grain),
    )
    x, y = torch.randn(6, 8), torch.randn(6, 1)
    torch.manual_seed(123)
    if fused:
        loss = model.forward_backward((x,), label=y, loss_fn=_mse_mb(3))
    else:
        out = model(x)
        loss = sum(
            nn.functional.mse_loss(o, t) / 3 for o, t in zip(out.tensor_split(3), y.tensor_split(3))
        )
        loss.backward()
    torch.manual_seed(123)
    base = int(torch.randint(0, 2**62, (1,)).item())
    ref_loss = seeded_reference_loss(ref, x, y, 3, base)
    ref_loss.backward()
    assert_close(loss.detach(), ref_loss.detach(), "loss with dropout")
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, f"grad {name} with dropout ({grain})")


class _ScalesByNoise(nn.Module):
    """Multiplies by noise drawn in forward; recompute reuses it via save_for_recompute."""

    events: list[str] = []  # class-level: shared with the device copies of the layer

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if roundpipe.doing_recompute():
            _ScalesByNoise.events.append("recompute")
            (noise,) = roundpipe.get_recompute_data()
        else:
            noise = torch.rand_like(x) + 0.5
            save_for_recompute(noise)
        return self.lin(x) * noise


def test_save_for_recompute_roundtrip(two_devices):
    layer = _ScalesByNoise()
    _ScalesByNoise.events.clear()
    model = RoundPipe(
        nn.Sequential(layer),
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=2, preserve_rng_state=False),
    )
    x = torch.randn(4, 8)
    out = model(x)
    out.sum().backward()
    assert _ScalesByNoise.events == ["recompute", "recompute"]
    with torch.no_grad():
        noise = out.detach() / layer.lin(x)
    w = layer.lin.weight.detach().clone().requires_grad_(True)
    (nn.functional.linear(x, w, layer.lin.bias.detach()) * noise).sum().backward()
    assert_close(layer.lin.weight.grad, w.grad, "grad with saved noise")
    assert roundpipe.doing_recompute() is False


@pytest.mark.parametrize("link_gbps", [None, 1.0], ids=["no_link", "link"])
def test_model_four_times_budget_trains_within_budget(link_gbps):
    net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(16)])
    size = sum(p.numel() * 4 for p in net.parameters())
    budget = size // 4
    devs = roundpipe.init_devices(num_virtual=2, memory_limit=budget, link_gbps=link_gbps)
    ref = copy.deepcopy(net)
    model = RoundPipe(net, pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = torch.optim.Adam(model.optim_parameters(), lr=1e-3)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    for _ in range(2):
        x, y = torch.randn(4, 32), torch.randn(4, 32)
        model.forward_backward((x,), label=y, loss_fn=_mse_mb(2))
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for d in devs:
        assert 0 < d.memory.peak <= budget, (d.memory.peak, budget)
        assert d.memory.resident == 0
    for p, q in zip(net.parameters(), ref.parameters()):
        assert_close(p, q, "parameters of the over-budget model")
    # a plan putting everything in one stage cannot fit: the budget is enforced
    plan = roundpipe.ModelExecutePlan()
    plan.fwd_plan = [range(0, 16)]
    plan.bwd_plan = [range(0, 16)]
    with pytest.raises(roundpipe.DeviceMemoryError, match="budget"):
        model.forward_backward(
            (torch.randn(4, 32),),
            label=torch.randn(4, 32),
            loss_fn=_mse_mb(2),
            run_config=RoundPipeRunConfig(execute_plan=plan),
        )
    assert all(d.memory.resident == 0 for d in devs)


class _Boom(nn.Module):
    def __init__(self, when: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.when = when
        self.armed = True

    def forward(self, x):
        hit = (
            roundpipe.doing_recompute()
            if self.when == "recompute"
            else not roundpipe.doing_recompute()
        )
        if self.armed and hit and x.shape[0] == 2:
            raise ValueError(f"boom in {self.when}")
        return self.lin(x)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["forward", "recompute"])
def test_layer_error_mid_pipeline_is_raised_without_hanging(ndev, link, when):
    boom = _Boom(when)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), boom, nn.Linear(8, 8), nn.Linear(8, 1))
    plan = roundpipe.ModelExecutePlan()
    plan.fwd_plan = [range(0, 2), range(2, 3), range(3, 5)]
    plan.bwd_plan = [range(3, 5), range(2, 3), range(0, 2)]
    model = RoundPipe(
        net,
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=plan),
    )
    x, y = torch.randn(6, 8), torch.randn(6, 1)
    with pytest.raises(ValueError, match=f"boom in {when}") as info:
        model.forward_backward((x,), label=y, loss_fn=_mse_mb(3))
    assert "RoundPipe" in "".join(getattr(info.value, "__notes__", []))
    assert all(d.memory.resident == 0 for d in roundpipe.get_devices())
    boom.armed = False  # the runtime is still usable afterwards
    model.forward_backward((x,), label=y, loss_fn=_mse_mb(3))


def test_optimizer_ctx_redirects_parameters(two_devices):
    model = RoundPipe(mlp(3), pin_model="off")
    optim_ids = {id(p) for p in model.optim_parameters()}
    with roundpipe.OptimizerCtx():
        assert {id(p) for p in model.parameters()} == optim_ids
    assert not optim_ids & {id(p) for p in model.parameters()}


def test_attribute_shim(two_devices):
    net = mlp(3)
    net.custom_flag = 1
    net.num_layers = "user value"  # same name as a RoundPipe attribute: must stay untouched
    model = RoundPipe(net, pin_model="off")
    assert model.num_layers == 5 and net.num_layers == "user value"
    assert model.custom_flag == 1
    model.custom_flag = 2
    assert net.custom_flag == 2
    orig = nn.Module()
    orig.only_here = "x"
    model.set_original_model(orig)
    assert model.only_here == "x"
    with pytest.raises(AttributeError, match="nope"):
        _ = model.nope


def test_attribute_shim_new_attributes_and_deletion_reach_both_models(two_devices):
    """A new attribute lands on the wrapped and the original model; del removes it from both."""
    net = mlp(3)
    orig = nn.Module()
    model = RoundPipe(net, pin_model="off")
    model.set_original_model(orig)
    model.new_flag = 1
    assert net.new_flag == 1 and orig.new_flag == 1 and model.new_flag == 1
    assert "new_flag" not in model.__dict__  # read back through the models, not a third copy
    net.new_flag = 2  # the wrapped model's value is the one seen
    assert model.new_flag == 2
    del model.new_flag
    assert not hasattr(net, "new_flag") and not hasattr(orig, "new_flag")
    assert not hasattr(model, "new_flag")
    with pytest.raises(AttributeError, match="new_flag"):
        del model.new_flag
    orig.only_orig = "x"  # an attribute only one model has is deleted from that one
    del model.only_orig
    assert not hasattr(orig, "only_orig")
    model.num_layers = 7  # the wrapper's own attributes stay the wrapper's
    assert model.num_layers == 7 and not hasattr(net, "num_layers")


@pytest.mark.slow
def test_async_training_with_roundpipe_adam(two_devices):
    try:
        from roundpipe.optim import Adam
    except ImportError:  # the C++ optimizer lands separately
        pytest.skip("roundpipe.optim not available")
    net0 = mlp(4)
    net = copy.deepcopy(net0)
    model = RoundPipe(net, pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = Adam(model.optim_parameters(), lr=1e-2)
    ref = copy.deepcopy(net0)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    torch.manual_seed(5)
    for _ in range(3):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        model.forward_backward((x,), label=y, loss_fn=_mse_mb(2))
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_optimizer_error_is_raised_in_main_thread(two_devices):
    model = RoundPipe(
        mlp(3), pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    model.forward_backward((x,), label=y, loss_fn=_mse_mb(2))
    with pytest.raises(ZeroDivisionError):
        model.step(lambda: 1 / 0, is_async=False)
    model.forward_backward((x,), label=y, loss_fn=_mse_mb(2))  # bookkeeping survived
    model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)


class _Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        import time

        time.sleep(1.5)
        return self.lin(x)


@pytest.mark.timeout(60)
def test_stuck_stage_times_out_instead_of_hanging(two_devices, monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_WAIT_TIMEOUT", "0.5")
    plan = roundpipe.ModelExecutePlan()
    plan.fwd_plan = [range(0, 1), range(1, 2)]
    model = RoundPipe(
        nn.Sequential(_Slow(), nn.Linear(8, 1)),
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=plan),
    )
    with pytest.raises(roundpipe.RoundPipeTimeoutError, match="forward group 0"), torch.no_grad():
        model(torch.randn(4, 8))
    monkeypatch.setenv("ROUNDPIPE_WAIT_TIMEOUT", "60")
    roundpipe.device.wait_devices_idle(timeout=30)


def test_default_name_is_call_site(two_devices):
    model = RoundPipe(mlp(3), pin_model="off")
    assert model.name.startswith("test_training.py:")


class _CtrlC(nn.Module):
    """Simulates Ctrl-C arriving while the main thread waits for the pipeline."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        import _thread
        import time

        _thread.interrupt_main()
        time.sleep(0.3)
        return self.lin(x)


@pytest.mark.timeout(60)
def test_ctrl_c_stops_cleanly(two_devices):
    model = RoundPipe(
        nn.Sequential(nn.Linear(8, 8), _CtrlC(), nn.Linear(8, 1)),
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(torch.randn(4, 8))
    roundpipe.device.wait_devices_idle(timeout=30)
    assert all(d.memory.resident == 0 for d in roundpipe.get_devices())


def test_callable_split_and_merge(two_devices):
    ref = mlp(3)
    calls = []

    def split(args, kwargs, n):
        calls.append(n)
        return [((chunk,), kwargs) for chunk in args[0].chunk(n)]

    cfg = RoundPipeRunConfig(
        num_microbatch=2, split_input=split, merge_output=lambda outs: torch.cat(outs) * 2
    )
    model = RoundPipe(copy.deepcopy(ref), pin_model="off", model_run_config=cfg)
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = model(x)
    assert calls == [2]
    assert_close(out, ref(x).detach() * 2, "custom merge")


def test_caller_autocast_applies_on_the_device_workers(two_devices):
    """autocast is thread-local: RoundPipe re-enters the caller's region on its workers, for
    the forward stages and for the recompute in backward."""
    ref = mlp(4, width=32)
    net = copy.deepcopy(ref)
    model = RoundPipe(net, pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        ref_out = ref(x)
    assert out.dtype == torch.bfloat16 == ref_out.dtype
    nn.functional.mse_loss(out.float(), y).backward()
    nn.functional.mse_loss(ref_out.float(), y).backward()
    # bf16 products, two microbatches against one batch
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2)
