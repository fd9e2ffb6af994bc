"""One training loop for every target (``slapo.train_step``, then the optimizer), and the registry.

The parametrized test runs the SAME loop function (``jobs_loop.loop``) on eager and roundpipe
here and on ddp, fsdp and pipeline in the suite's 2-rank gloo job; every loss curve must be the
plain PyTorch loop's.
"""

from __future__ import annotations

import copy

import jobs_loop
import pytest
import torch
from torch import nn

import slapo
from dist_utils import assert_check
from slapo.exceptions import TargetError
from slapo.targets import get_dialect_cls, get_target, init_target_engine, list_targets


@pytest.fixture
def roundpipe_devices(monkeypatch):
    import roundpipe
    from roundpipe import device, optim_stream

    monkeypatch.setenv("ROUNDPIPE_WAIT_TIMEOUT", "60")
    roundpipe.init_devices(num_virtual=2)  # CPU virtual devices; the optimizer steps in sync
    yield
    optim_stream.synchronize_optim()
    device.wait_devices_idle(timeout=30)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("target", ["eager", "roundpipe", "ddp", "fsdp", "pipeline"])
def test_one_loop_trains_every_target_like_pytorch(target, request):
    if target in ("ddp", "fsdp", "pipeline"):
        assert_check(request.getfixturevalue("ranks2"), f"loop_{target}")
        return
    if target == "roundpipe":
        request.getfixturevalue("roundpipe_devices")
    jobs_loop.check(target)


@pytest.mark.timeout(240)
def test_pipeline_engine_names_a_batch_it_cannot_take(ranks2):
    assert_check(ranks2, "loop_pipeline_batches")


# ----- the batch forms of train_step ---------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _plain_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


class _KwargsModel(nn.Module):
    """A model whose forward takes keyword arguments and returns its loss, as HF models do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"logits": out, "loss": nn.functional.mse_loss(out, labels)}


@pytest.mark.parametrize("form", ["tuple+loss_fn", "mapping+loss_fn", "mapping+output_loss"])
def test_train_step_runs_forward_and_backward_of_each_batch_form(form):
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    ref = _mlp()
    want_loss, want_grads = _plain_grads(ref, x, y)
    model = _KwargsModel() if form == "mapping+output_loss" else _mlp()
    if form == "tuple+loss_fn":
        loss = slapo.train_step(model, (x, y), loss_fn=nn.functional.mse_loss)
    elif form == "mapping+loss_fn":
        loss = slapo.train_step(model, {"input": x, "labels": y}, loss_fn=nn.functional.mse_loss)
    else:
        loss = slapo.train_step(model, {"x": x, "labels": y})
    assert not loss.requires_grad
    # Exact: the same kernels on the same operands as the plain loop
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    for p, g in zip(model.parameters(), want_grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_train_step_uses_the_models_own_train_step():
    class Engine:
        def __init__(self) -> None:
            self.seen = []

        def train_step(self, batch):
            self.seen.append(batch)
            return torch.tensor(1.5, requires_grad=True)

    engine = Engine()
    loss = slapo.train_step(engine, {"input_ids": torch.ones(2, 3)})
    assert loss.item() == 1.5 and not loss.requires_grad and len(engine.seen) == 1
    with pytest.raises(TargetError, match="loss_fn= there"):
        slapo.train_step(engine, {}, loss_fn=nn.functional.mse_loss)


@pytest.mark.parametrize(
    ("batch", "loss_fn", "text"),
    [
        ({"input": torch.randn(2, 4)}, nn.functional.mse_loss, '"labels" entry'),
        ((torch.randn(2, 4),), nn.functional.mse_loss, "last item"),
        (torch.randn(2, 4), nn.functional.mse_loss, "not one tensor"),
        (torch.randn(2, 4), None, "carries no loss"),
        ("text", None, "got str"),
    ],
)
def test_train_step_bad_batches_are_clear_errors(batch, loss_fn, text):
    with pytest.raises(TargetError, match=text):
        slapo.train_step(_mlp(), batch, loss_fn=loss_fn)


def test_ordinary_loop_and_contract_loop_train_alike():
    """Where a forward returns the loss, ``loss.backward(); opt.step()`` is the contract too."""
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    curves = []
    for contract in (True, False):
        model, opt = slapo.build(
            slapo.create_schedule(_KwargsModel()),
            optimizer=torch.optim.SGD,
            optimizer_kwargs={"lr": 0.1},
        )
        losses = []
        for _ in range(3):
            if contract:
                loss = slapo.train_step(model, {"x": x, "labels": y})
            else:
                loss = model(x, labels=y)["loss"]
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        curves.append(losses)
    assert curves[0] == curves[1] and curves[0][-1] < curves[0][0]


# ----- the registry ----------------------------------------------------------------------------------
def test_registry_is_keyed_by_target_name():
    assert {"eager", "ddp", "fsdp", "pipeline", "roundpipe", "deepspeed"} <= set(list_targets())
    assert get_dialect_cls("runtime_engine", None) is get_target("eager") is get_target("")
    assert get_dialect_cls("runtime_engine", "nope", allow_none=True) is None
    with pytest.raises(TargetError, match='no build target "nope"; available targets: ddp'):
        get_dialect_cls("runtime_engine", "nope")
    for allow_none in (False, True):
        with pytest.raises(TargetError, match='cls_type "pipeline_stage".*runtime_engine'):
            get_dialect_cls("pipeline_stage", "eager", allow_none=allow_none)
    model = _mlp()
    built, opt = init_target_engine(slapo.create_schedule(copy.deepcopy(model)), "eager")
    assert isinstance(built, nn.Sequential) and opt is None
