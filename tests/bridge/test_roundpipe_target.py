"""slapo.build(sch, target="roundpipe"): a scheduled model trains on RoundPipe like plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import llama
from torch import nn

import roundpipe
import slapo
from roundpipe import device, optim_stream


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
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
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
