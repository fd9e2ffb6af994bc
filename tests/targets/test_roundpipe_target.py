"""slapo.build(sch, target="roundpipe"): a scheduled model trains on RoundPipe like plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import delayed_update_reference
from torch import nn

import roundpipe
import slapo
from hf_models import llama
from roundpipe import device, optim_stream
from roundpipe.optim import RoundPipeOptimizer


@pytest.fixture(autouse=True)
def _devices(monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_WAIT_TIMEOUT", "60")
    roundpipe.init_devices(num_virtual=2)
    yield
    optim_stream.synchronize_optim()
    device.wait_devices_idle(timeout=30)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


def test_sequential_with_cuts_and_checkpoint_trains_like_pytorch():
    ref = _mlp()
    sch = slapo.create_schedule(copy.deepcopy(ref))
    sch["1"].cut_pipeline_stage()
    sch["3"].cut_pipeline_stage()
    sch["2"].checkpoint()
    model, opt = slapo.build(
        sch,
        target="roundpipe",
        num_microbatch=2,
        pin_model="off",
        optimizer=torch.optim.SGD,
        optimizer_kwargs={"lr": 0.1},
    )
    plan = model.model_run_config.execute_plan
    assert [list(r) for r in plan.fwd_plan] == [[0, 1], [2, 3], [4]]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        loss = model.forward_backward(
            (x,), label=y, loss_fn=lambda out, t: nn.functional.mse_loss(out, t) / 2
        )
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(
            loss, ref_loss.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step}"
        )
        opt.step()  # forward_backward did the backward: the ordinary step applies it
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(sch.mod.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg="after 3 steps")


def test_llama_preset_takes_cuts_from_the_schedule():
    ref = llama(dropout=0.0, layers=3)
    hf = copy.deepcopy(ref)
    sch = slapo.create_schedule(hf)
    sch["model.layers.0"].cut_pipeline_stage()
    sch["model.layers.1"].checkpoint()
    model, _ = slapo.build(sch, target="roundpipe", num_microbatch=2, pin_model="off")
    # preset layers: embedding | 3 decoder layers | norm + head -> cut after decoder layer 0 (index 1)
    assert [list(r) for r in model.model_run_config.execute_plan.fwd_plan] == [[0, 1], [2, 3, 4]]
    ids = torch.randint(0, 96, (4, 8))

    def loss_fn(out, labels):
        logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
        return nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1)) / 2

    loss = model.forward_backward(input_kwargs={"input_ids": ids}, label=ids, loss_fn=loss_fn)
    ref_out = ref(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    torch.testing.assert_close(loss, ref_out.loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(hf.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_bad_cuts_are_clear_errors():
    sch = slapo.create_schedule(_mlp())
    sch["4"].cut_pipeline_stage()
    with pytest.raises(slapo.TargetError, match="empty stage"):
        slapo.build(sch, target="roundpipe", pin_model="off")
    sch = slapo.create_schedule(_mlp())
    with pytest.raises(slapo.TargetError, match="not both"):
        slapo.build(
            sch, target="roundpipe", num_microbatch=2, run_config=roundpipe.RoundPipeRunConfig()
        )


def _ordinary_loop(model, opt, sched, data):
    """The plain PyTorch training loop (what slapo.train.Runner.step runs)."""
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.detach())
    return losses


def _decay(step):
    return 0.7**step


def _data(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(n)]


def _build(ref, async_step=False, lr=0.05):
    sch = slapo.create_schedule(copy.deepcopy(ref))
    sch["1"].cut_pipeline_stage()
    model, opt = slapo.build(
        sch,
        target="roundpipe",
        num_microbatch=2,
        pin_model="off",
        optimizer=torch.optim.AdamW,
        optimizer_kwargs={"lr": lr},
        async_step=async_step,
    )
    return sch.mod, model, opt


def test_ordinary_pytorch_loop_trains_like_pytorch():
    """build(target="roundpipe") + loss.backward(); opt.step(); opt.zero_grad() + LambdaLR
    gives plain torch training: losses, final parameters, optimizer state and lr."""
    ref = _mlp()
    init = copy.deepcopy(ref)
    net, model, opt = _build(ref)
    assert isinstance(opt, RoundPipeOptimizer) and isinstance(opt.optimizer, torch.optim.AdamW)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    data = _data(4)
    losses = _ordinary_loop(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _decay), data)
    ref_losses = _ordinary_loop(
        ref, ref_opt, torch.optim.lr_scheduler.LambdaLR(ref_opt, _decay), data
    )
    # RoundPipe runs microbatches and concatenates / averages them: float32 sums may be
    # ordered differently than in one full-batch pass, hence assert_close and not equality
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    for (name, p), q, p0 in zip(net.named_parameters(), ref.parameters(), init.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")
        assert not torch.equal(p, p0), f"{name} did not change"
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"]  # lr after 4 scheduler steps included
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i, st in sd["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(st[key], ref_sd["state"][i][key])
    # state dicts move both ways: load torch's into ours and continue: still the same training
    opt.load_state_dict(copy.deepcopy(ref_sd))  # state_dict() shares the live tensors
    more = _data(2, seed=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _decay)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _decay)
    torch.testing.assert_close(
        torch.stack(_ordinary_loop(model, opt, sched, more)),
        torch.stack(_ordinary_loop(ref, ref_opt, ref_sched, more)),
    )
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_ordinary_loop_with_async_step_equals_the_delayed_update_reference():
    """async_step=True: iteration k runs on the weights after step k-2 (RoundPipe's overlap)."""
    ref = _mlp()
    net, model, opt = _build(ref, async_step=True)
    assert opt.is_async
    data = _data(5)
    losses = _ordinary_loop(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _decay), data)
    ref_losses, master, ref_opt = delayed_update_reference(
        ref,
        data,
        lambda ps: torch.optim.AdamW(ps, lr=0.05),
        make_sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, _decay),
    )
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    model.synchronize()
    for p, q in zip(net.parameters(), master.parameters()):
        torch.testing.assert_close(p, q)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
