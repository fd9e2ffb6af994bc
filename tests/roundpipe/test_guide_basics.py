"""User guide: Overview, Wrap Model, RoundPipeRunConfig, Multi-GPU Training, Resolving OOM.

The pages' code on CPU virtual devices (``roundpipe.init_devices(num_virtual=N)`` stands in for N
CUDA GPUs; pinning and CUDA_VISIBLE_DEVICES have no CPU counterpart), with random weights and
synthetic batches (a tiny random Qwen3 from ``transformers`` where a page loads one from the hub).
Every run is checked against plain PyTorch: loss and gradients / parameters within rtol 1e-5 and
atol 1e-6 in float32, rtol 1e-3 / atol 1e-3 for float16 models (float32 optimizer copies).
"""

from __future__ import annotations

import copy

import torch
from guide_reference import (
    PlainTrainer,
    assert_grads,
    assert_params,
    batches,
    split_mb,
    wrap,
)
from helpers import tiny_qwen3
from torch import nn

import roundpipe
from roundpipe import (
    AutoRoundPipe,
    ModelExecutePlan,
    OptimizerCtx,
    RoundPipe,
    RoundPipeRunConfig,
    wrap_model_to_roundpipe,
)
from roundpipe.devices import device


def _mlp(seed: int = 0, width: int = 16, n_hidden: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, width), nn.Tanh()]
    for _ in range(n_hidden):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 2))


class _Counting:
    """A loss_fn that counts its calls (one per microbatch)."""

    def __init__(self, divide_by: int = 1) -> None:
        self.calls = 0
        self.divide_by = divide_by

    def __call__(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return nn.functional.mse_loss(outputs, labels) / self.divide_by


def _on_devices(n: int) -> None:
    device.wait_devices_idle(timeout=30)
    roundpipe.init_devices(num_virtual=n)


# -- Overview -----------------------------------------------------------------------------------
def test_overview_microbatch_loss_is_the_sum_and_the_mean_matches_the_batch(two_devices):
    """Batch 12, num_microbatch 3: the returned loss is loss_0 + loss_1 + loss_2 and the gradients
    are the sum of the per-microbatch ones; dividing by num_microbatch in loss_fn gives the whole
    batch's mean loss and gradient (one plain backward over the batch)."""
    net = _mlp()
    ref = copy.deepcopy(net)
    model = wrap(net, num_microbatch=3)
    criterion = nn.MSELoss()
    x, y = torch.randn(12, 8), torch.randn(12, 2)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=criterion)
    parts = [criterion(ref(xb), yb) for xb, yb in zip(x.tensor_split(3), y.tensor_split(3))]
    for part in parts:
        part.backward()
    assert_params([loss], [sum(p.detach() for p in parts)], "sum of microbatch losses")
    assert_grads(net, ref, "sum of microbatch gradients")

    model.zero_grad()
    ref.zero_grad()
    loss = model.forward_backward(
        input_args=(x,), label=y, loss_fn=lambda outputs, labels: criterion(outputs, labels) / 3
    )
    whole = criterion(ref(x), y)
    whole.backward()
    assert_params([loss], [whole], "mean loss")
    assert_grads(net, ref, "whole-batch gradients")


# -- Wrap Model ---------------------------------------------------------------------------------
class MyBlock(nn.Module):
    """The page's block: writes its standalone buffer, never its instance variables, and makes
    its temporary tensors on the input's / weight's device."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.register_buffer("acc", torch.zeros(16))
        self.call_count = 0  # read-only in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[0], device=x.device, dtype=x.dtype)
        bias = torch.zeros(self.linear.weight.shape[0], device=self.linear.weight.device)
        out = torch.tanh(self.linear(x)) * mask.unsqueeze(-1) + bias.to(x.dtype)
        self.acc.add_(out.mean(dim=0).detach())
        return out


def test_wrap_model_custom_sequential(two_devices):
    """RoundPipe(my_sequential_model.to(float16), optim_dtype=float32, model_run_config=
    RoundPipeRunConfig(num_microbatch=4), pin_model="alloc") trains like plain PyTorch (float16
    model, float32 master weights, one step stale); the blocks' buffers, written in forward, hold
    what plain PyTorch's hold (recompute does not write them again)."""
    torch.manual_seed(0)
    my_sequential_model = nn.Sequential(*[MyBlock() for _ in range(4)], nn.Linear(16, 2))
    half = copy.deepcopy(my_sequential_model).to(torch.float16)
    model = RoundPipe(
        model=my_sequential_model.to(torch.float16),
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=4),
        pin_model="alloc",
    )
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    ref = PlainTrainer(half, lambda ps: torch.optim.SGD(ps, lr=0.1), optim_dtype=torch.float32)

    def loss_fn(outputs, labels):
        return nn.functional.mse_loss(outputs.float(), labels) / 4

    for x, y in batches(3, (8, 16), 2, seed=1):
        x = x.to(torch.float16)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        ref_loss = ref.forward_backward((x,), {}, y, loss_fn, 4)
        assert_params([loss], [ref_loss], "loss", 1e-3, 1e-3)
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        ref.step()
    model.synchronize()
    plain = ref.synchronized()
    assert_params(model.model.parameters(), plain.parameters(), "parameters", 1e-3, 1e-3)
    assert_params(model.model.buffers(), plain.buffers(), "written buffers", 1e-3, 1e-3)
    assert all(b.call_count == 0 for b in model.model[:4])


def _tiny_qwen3() -> nn.Module:
    return tiny_qwen3(use_cache=False).to(torch.float16)


def test_wrap_model_preset(two_devices):
    """wrap_model_to_roundpipe(model, use_sequential_preset=True, model_run_config=...,
    optim_dtype=float32): a RoundPipe over the preset's Sequential whose forward equals the
    model's and through which the model's attributes (vocab_size, config) stay readable."""
    hf = _tiny_qwen3()
    ref = copy.deepcopy(hf)
    model = wrap_model_to_roundpipe(
        hf,
        use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(num_microbatch=4),
        optim_dtype=torch.float32,
        pin_model="off",
    )
    assert isinstance(model, RoundPipe) and model.num_layers == 4  # prefix, 2 layers, postfix
    assert model.vocab_size == 64 and model.config.model_type == "qwen3"
    assert {p.dtype for p in model.optim_parameters()} == {torch.float32}
    ids = torch.randint(0, 64, (4, 6))
    with torch.no_grad():
        got = model(input_ids=ids).logits
        want = ref(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


class _NotSequential(nn.Module):
    """A model RoundPipe cannot read as a Sequential (a loop over a ModuleList)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 96)
        self.blocks = nn.ModuleList([nn.Linear(96, 96) for _ in range(3)])
        self.head = nn.Linear(96, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def test_wrap_model_automatic_splitting(two_devices):
    """wrap_model_to_roundpipe(model, use_sequential_preset=False, optim_dtype=float32) of a
    model with no Sequential form: an AutoRoundPipe whose forward() + backward + step trains
    like plain PyTorch (float16 model, float32 master weights, synchronous step)."""
    torch.manual_seed(0)
    net = _NotSequential().to(torch.float16)
    half = copy.deepcopy(net)
    model = wrap_model_to_roundpipe(
        net, use_sequential_preset=False, optim_dtype=torch.float32, pin_model="off"
    )
    assert isinstance(model, AutoRoundPipe) and model.sub_roundpipes
    with OptimizerCtx():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = PlainTrainer(
        half, lambda ps: torch.optim.SGD(ps, lr=0.1), optim_dtype=torch.float32, is_async=False
    )
    for x, y in batches(2, (6, 8), 2, seed=2):
        x = x.to(torch.float16)
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        ref_loss = ref.forward_backward(
            (x,), {}, y, lambda o, t: nn.functional.mse_loss(o.float(), t), 1
        )
        assert_params([loss], [ref_loss], "loss", 1e-3, 1e-3)
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        ref.step()
    assert_params(model.optim_parameters(), ref.master, "optimizer copies", 1e-3, 1e-4)


# -- RoundPipeRunConfig -------------------------------------------------------------------------
def test_run_config_levels_and_fields(two_devices):
    """Model-level num_microbatch=4 applies to every call, a per-call RoundPipeRunConfig(
    num_microbatch=8) overrides it for that call; without either the default is devices + 1;
    recompute_grain="layer" gives the same numbers as "stage"; outputs land on the CPU."""
    net = _mlp()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=4), pin_model="off")
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    cases = [
        (None, 4),
        (RoundPipeRunConfig(num_microbatch=8), 8),
        (RoundPipeRunConfig(recompute_grain="layer"), 4),
        (RoundPipeRunConfig(recompute_grain="stage", output_device=torch.device("cpu")), 4),
    ]
    for cfg, n_mb in cases:
        loss_fn = _Counting(divide_by=n_mb)
        loss, out = model.forward_backward(
            input_args=(x,), label=y, loss_fn=loss_fn, return_outputs=True, run_config=cfg
        )
        assert loss_fn.calls == n_mb, f"{cfg}: {loss_fn.calls} microbatches"
        assert out.device == torch.device("cpu")
        ref_loss = torch.zeros(())
        for xb, yb in zip(split_mb(x, n_mb), split_mb(y, n_mb)):
            part = nn.functional.mse_loss(ref(xb), yb) / n_mb
            part.backward()
            ref_loss = ref_loss + part.detach()
        assert_params([loss, out], [ref_loss, ref(x)], f"loss and outputs with {cfg}")
        assert_grads(net, ref, f"gradients with {cfg}")
        model.zero_grad()
        ref.zero_grad()
    default = RoundPipe(_mlp(), pin_model="off")  # neither level sets it: devices + 1
    loss_fn = _Counting()
    default.forward_backward(
        input_args=(torch.randn(6, 8),), label=torch.randn(6, 2), loss_fn=loss_fn
    )
    assert loss_fn.calls == roundpipe.get_num_devices() + 1 == 3


# -- Multi-GPU Training -------------------------------------------------------------------------
def _train_fixed_microbatches(n_devices: int, net: nn.Module, data: list) -> tuple[list, list]:
    _on_devices(n_devices)
    model = RoundPipe(
        copy.deepcopy(net),
        optim_dtype=torch.float32,
        pin_model="off",
        model_run_config=RoundPipeRunConfig(num_microbatch=4),
    )
    with OptimizerCtx():
        optimizer = roundpipe.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in data:
        losses.append(
            model.forward_backward(
                input_args=(x,), label=y, loss_fn=lambda o, t: nn.functional.mse_loss(o, t) / 4
            )
        )
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
    model.synchronize()
    return losses, [p.detach().clone() for p in model.model.parameters()]


def test_multi_gpu_same_script_any_device_count():
    """The same script on 1, 2 and 3 devices with a fixed num_microbatch gives the same losses
    and parameters, equal to plain PyTorch; left unset, num_microbatch is devices + 1."""
    net = _mlp()
    data = batches(3, (8, 8), 2, seed=3)
    ref = PlainTrainer(net, lambda ps: torch.optim.Adam(ps, lr=1e-2))
    ref_losses = []
    for x, y in data:
        ref_losses.append(
            ref.forward_backward((x,), {}, y, lambda o, t: nn.functional.mse_loss(o, t) / 4, 4)
        )
        ref.step()
    want = list(ref.synchronized().parameters())
    before = roundpipe.get_num_devices()
    try:
        for n in (1, 2, 3):
            losses, params = _train_fixed_microbatches(n, net, data)
            assert_params(losses, ref_losses, f"losses on {n} devices")
            assert_params(params, want, f"parameters on {n} devices", 1e-5, 1e-5)
            loss_fn = _Counting()
            RoundPipe(_mlp(), pin_model="off").forward_backward(
                input_args=(torch.randn(12, 8),), label=torch.randn(12, 2), loss_fn=loss_fn
            )
            assert loss_fn.calls == n + 1
    finally:
        _on_devices(before)


# -- Resolving OOM ------------------------------------------------------------------------------
def test_resolve_oom_remedies(two_devices):
    """Each GPU-OOM remedy keeps the numbers: num_microbatch=16, recompute_grain="layer", a plan
    from ModelExecutePlan.auto(..., model_memory_limit=...) whose every stage fits half the
    limit; and each CPU-OOM remedy: pin_model "register" / "off", and two forward_backward calls
    of half the batch (num_microbatch=8) before one step, equal to one call of num_microbatch=16."""
    net = _mlp(n_hidden=4)
    x, y = torch.randn(32, 8), torch.randn(32, 2)

    def loss_fn(outputs, labels):
        return nn.functional.mse_loss(outputs, labels) / 16

    def check(model: RoundPipe, loss: torch.Tensor, what: str) -> None:
        ref = PlainTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1))
        ref_loss = ref.forward_backward((x,), {}, y, loss_fn, 16)
        assert_params([loss], [ref_loss], f"{what} loss")
        assert_grads(model.model, ref.model, f"{what} gradients")

    # 1. more microbatches, 2. layer grain, 3. a memory-capped plan
    model = RoundPipe(copy.deepcopy(net), pin_model="off")
    config = RoundPipeRunConfig(num_microbatch=16)
    check(model, model.forward_backward((x,), label=y, loss_fn=loss_fn, run_config=config), "16 mb")
    model = RoundPipe(copy.deepcopy(net), pin_model="off")
    config = RoundPipeRunConfig(num_microbatch=16, recompute_grain="layer")
    check(model, model.forward_backward((x,), label=y, loss_fn=loss_fn, run_config=config), "layer")
    model = RoundPipe(copy.deepcopy(net), pin_model="off")
    limit_gb = 2.5 * max(b + g for b, g in zip(model.layer_bytes, model.layer_grad_bytes)) / 1024**3
    plan = ModelExecutePlan.auto("fused", model, model_memory_limit=limit_gb)
    for stage in plan.fwd_plan + plan.bwd_plan:
        stage_bytes = sum(model.layer_bytes[i] + model.layer_grad_bytes[i] for i in stage)
        assert stage_bytes <= limit_gb * 1024**3 / 2
    assert len(plan.bwd_plan) > 2
    config = RoundPipeRunConfig(num_microbatch=16, execute_plan=plan)
    check(model, model.forward_backward((x,), label=y, loss_fn=loss_fn, run_config=config), "plan")

    # CPU OOM: pinning modes, manual gradient accumulation
    for pin in ("register", "off"):
        model = RoundPipe(copy.deepcopy(net), pin_model=pin)
        loss = model.forward_backward((x,), label=y, loss_fn=loss_fn, run_config=config)
        check(model, loss, f"pin_model={pin}")
    model = RoundPipe(copy.deepcopy(net), pin_model="off")
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    config = RoundPipeRunConfig(num_microbatch=8)
    batch_part1, batch_part2 = x.chunk(2)
    labels1, labels2 = y.chunk(2)
    loss1 = model.forward_backward(
        (batch_part1,), label=labels1, loss_fn=loss_fn, run_config=config
    )
    loss2 = model.forward_backward(
        (batch_part2,), label=labels2, loss_fn=loss_fn, run_config=config
    )
    check(model, loss1 + loss2, "accumulated halves")
    model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
    model.synchronize()
    ref = PlainTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1))
    ref.forward_backward((x,), {}, y, loss_fn, 16)
    ref.step()
    assert_params(model.model.parameters(), ref.synchronized().parameters(), "one step")
