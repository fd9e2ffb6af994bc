"""RoundPipe on a real GPU: streams, events, pinned memory, the memory budget, and training
that equals plain PyTorch (synchronous: the same kernels on the same operands; asynchronous:
the one-step-stale reference)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import delayed_update_reference, mlp
from torch import nn

import roundpipe
from roundpipe import DeviceMemoryError, RoundPipe, RoundPipeRunConfig
from roundpipe.runtime.rng import derive_seed


def _mse(n_mb: int):
    return lambda out, y: nn.functional.mse_loss(out, y) / n_mb


def test_each_device_has_four_streams_and_events_order_them(gpu):
    dev = roundpipe.get_devices()[0]
    assert dev.is_cuda and dev.device.type == "cuda"
    streams = [dev.param_upstream, dev.upstream, dev.compute_stream, dev.downstream]
    assert len({s.cuda_stream for s in streams}) == 4, "streams must be distinct"
    assert all(s.cuda_stream != torch.cuda.current_stream().cuda_stream for s in streams)
    host = torch.randn(1 << 20).pin_memory()
    with dev.stream(dev.upstream):
        on_dev = host.to(dev.device, non_blocking=True)
        ev = dev.new_event()
        ev.record(dev.upstream)
    with dev.stream(dev.compute_stream):
        dev.compute_stream.wait_event(ev)
        doubled = on_dev * 2
    dev.compute_stream.synchronize()
    torch.testing.assert_close(doubled.cpu(), host * 2, rtol=0, atol=0)


@pytest.mark.parametrize("pin_model", ["alloc", "register"])
def test_pinned_model_trains_like_pytorch(gpu, pin_model):
    ref = mlp(5, width=64).cuda()
    net = mlp(5, width=64)
    model = RoundPipe(
        net, pin_model=pin_model, model_run_config=RoundPipeRunConfig(num_microbatch=4)
    )
    assert all(p.is_pinned() for p in net.parameters()), f"pin_model={pin_model} did not pin"
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.optim_parameters(), lr=1e-2)
    torch.manual_seed(1)
    for step in range(4):
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        ref_loss = nn.functional.mse_loss(ref(x.cuda()), y.cuda())
        ref_loss.backward()
        loss = model.forward_backward((x,), label=y, loss_fn=_mse(4))
        # four microbatch losses summed on the host versus one mean on the GPU: a reordered sum
        torch.testing.assert_close(loss.cpu(), ref_loss.detach().cpu(), msg=f"loss {step}")
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad.cpu(), msg=f"grad at step {step}")
        ref_opt.step()
        ref_opt.zero_grad()
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q.detach().cpu())


def test_sync_training_with_one_microbatch_is_bit_identical(gpu):
    """One microbatch: RoundPipe runs the very kernels plain PyTorch runs, on the same operands
    (weights copied up, gradients copied down), so the results are equal bit for bit."""
    ref = mlp(4, width=128).cuda()
    net = mlp(4, width=128)
    model = RoundPipe(net, pin_model="alloc", model_run_config=RoundPipeRunConfig(num_microbatch=1))
    torch.manual_seed(2)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    ref_loss = nn.functional.mse_loss(ref(x.cuda()), y.cuda())
    ref_loss.backward()
    loss = model.forward_backward((x,), label=y, loss_fn=_mse(1))
    assert torch.equal(loss.cpu(), ref_loss.detach().cpu())
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad.cpu()), f"grad of {name} differs"


def test_async_training_matches_delayed_update_reference(gpu):
    net0 = mlp(5, width=64)
    torch.manual_seed(3)
    data = [(torch.randn(12, 8), torch.randn(12, 1)) for _ in range(5)]
    ref_losses, ref_model, _ = delayed_update_reference(
        net0, data, lambda ps: torch.optim.Adam(ps, lr=1e-2)
    )
    net = copy.deepcopy(net0)
    model = RoundPipe(net, pin_model="alloc", model_run_config=RoundPipeRunConfig(num_microbatch=3))
    opt = torch.optim.Adam(model.optim_parameters(), lr=1e-2)
    for k, (x, y) in enumerate(data):
        loss = model.forward_backward((x,), label=y, loss_fn=_mse(3))
        torch.testing.assert_close(loss.cpu(), ref_losses[k], msg=f"loss at iteration {k}")
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    model.synchronize()
    for p, q in zip(net.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q)


def test_cxx_adam_async_trains_on_gpu(gpu):
    net0 = mlp(4, width=64)
    torch.manual_seed(4)
    data = [(torch.randn(12, 8), torch.randn(12, 1)) for _ in range(4)]
    ref_losses, ref_model, _ = delayed_update_reference(
        net0, data, lambda ps: torch.optim.Adam(ps, lr=1e-2)
    )
    net = copy.deepcopy(net0)
    model = RoundPipe(net, pin_model="alloc", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = roundpipe.Adam(model.optim_parameters(), lr=1e-2)
    for k, (x, y) in enumerate(data):
        loss = model.forward_backward((x,), label=y, loss_fn=_mse(2))
        torch.testing.assert_close(loss.cpu(), ref_losses[k], msg=f"loss at iteration {k}")
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
    model.synchronize()
    for p, q in zip(net.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q)


def _plan(n_layers: int, per_stage: int) -> roundpipe.ModelExecutePlan:
    plan = roundpipe.ModelExecutePlan()
    stages = [range(i, min(i + per_stage, n_layers)) for i in range(0, n_layers, per_stage)]
    plan.fwd_plan = stages
    plan.bwd_plan = stages[::-1]
    return plan


def test_device_budget_is_enforced_on_the_gpu():
    width = 512
    layer_bytes = (width * width + width) * 4
    budget = 3 * layer_bytes  # room for one layer with its gradient, not for two of them
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    x, y = torch.randn(8, width), torch.randn(8, width)
    roundpipe.init_devices(backend="cuda", memory_limit=budget)
    too_big = RoundPipeRunConfig(num_microbatch=2, execute_plan=_plan(4, 2))
    model = RoundPipe(copy.deepcopy(net), pin_model="off", model_run_config=too_big)
    with pytest.raises(DeviceMemoryError):
        model.forward_backward((x,), label=y, loss_fn=_mse(2))
    roundpipe.init_devices(backend="cuda", memory_limit=budget)
    fits = RoundPipeRunConfig(num_microbatch=2, execute_plan=_plan(4, 1))
    model = RoundPipe(copy.deepcopy(net), pin_model="off", model_run_config=fits)
    model.forward_backward((x,), label=y, loss_fn=_mse(2))  # cuBLAS workspaces, one per stream
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model.forward_backward((x,), label=y, loss_fn=_mse(2))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # the budget counts weights and gradients; activations and workspaces come on top
    activations = 64 * 8 * width * 4
    assert 0 < peak <= budget + activations, (peak, budget)
    assert all(d.memory.peak <= budget for d in roundpipe.get_devices())


def test_grad_scaler_with_fp16_autocast(gpu):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1)).cuda()
    net = copy.deepcopy(ref).cpu()
    model = RoundPipe(net, pin_model="alloc", model_run_config=RoundPipeRunConfig(num_microbatch=1))
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = roundpipe.GradScaler(init_scale=2.0**10, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
    for i in range(5):
        x, y = torch.randn(8, 16), torch.randn(8, 1)
        if i == 2:
            x[0, 0] = float("inf")  # overflow: the step is skipped and the scale backs off
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
            ref_out = ref(x.cuda())
        assert out.dtype == torch.float16 and ref_out.dtype == torch.float16
        scaler.scale(nn.functional.mse_loss(out.float(), y.to(out.device))).backward()
        model.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=False)
        scaler.update()
        ref_scaler.scale(nn.functional.mse_loss(ref_out.float(), y.cuda())).backward()
        ref_scaler.step(ref_opt)
        ref_opt.zero_grad()
        ref_scaler.update()
        model.synchronize()
        assert scaler.get_scale() == ref_scaler.get_scale(), f"scale at step {i}"
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q.detach().cpu(), rtol=1e-3, atol=1e-4)


def test_recompute_replays_cuda_dropout_masks(gpu):
    """Dropout on the GPU: RoundPipe's recompute draws the mask of the forward, layer ``l`` of
    microbatch ``m`` from ``derive_seed(run seed, l, m)`` on the CUDA generator."""
    net = mlp(4, width=32, dropout=0.5)
    model = RoundPipe(net, pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    ref = copy.deepcopy(net).cuda()
    torch.manual_seed(5)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    state = torch.get_rng_state()
    loss = model.forward_backward((x,), label=y, loss_fn=_mse(2))
    torch.set_rng_state(state)
    base_seed = int(torch.randint(0, 2**62, (1,)).item())  # what the run drew
    total = torch.zeros((), device="cuda")
    gen = torch.cuda.default_generators[0]
    for m, (xb, yb) in enumerate(zip(x.cuda().tensor_split(2), y.cuda().tensor_split(2))):
        h = xb
        for li, layer in enumerate(ref):
            saved = gen.get_state()
            gen.manual_seed(derive_seed(base_seed, li, m))
            h = layer(h)
            gen.set_state(saved)
        total = total + nn.functional.mse_loss(h, yb) / 2
    total.backward()
    torch.testing.assert_close(loss.cpu(), total.detach().cpu())
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad.cpu(), msg=f"grad of {name}")


def test_lora_model_trains_on_the_gpu_like_pytorch(gpu):
    """A peft LoRA Llama on RoundPipe: frozen weights are uploaded, never downloaded; only the
    adapters have optimizer copies; the loss curve is plain PyTorch's on the same GPU."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=32,
        use_cache=False,
    )
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    base = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), lora)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)  # peft starts B at zero: make every adapter gradient count
    ref = copy.deepcopy(base).cuda()
    frozen_before = {
        n: p.detach().clone() for n, p in base.named_parameters() if not p.requires_grad
    }
    model = roundpipe.wrap_model_to_roundpipe(
        base, model_run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    trainable = {n for n, p in ref.named_parameters() if p.requires_grad}
    assert {n for n, _ in model.optim_named_parameters()} == trainable
    opt = roundpipe.RoundPipeOptimizer(model, torch.optim.AdamW(model.optim_parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    losses, ref_losses = [], []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
        ref_loss = ref(input_ids=ids.cuda(), labels=ids.cuda()).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.detach().cpu())
    # two microbatches against one batch: float32 tolerance
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-5)
    assert losses[-1] < losses[0]
    for name, p in base.named_parameters():
        if name in frozen_before:
            assert torch.equal(p, frozen_before[name]), f"frozen {name} changed"
            assert p.grad is None, f"frozen {name} got a gradient"
