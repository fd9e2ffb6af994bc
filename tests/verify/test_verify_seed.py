"""Verify as the reference API has it: Verify(sch, example_inputs, device="cuda", eval_mode=True,
enable=True)."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from torch import nn

import slapo


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 4))


class _Messages(logging.Handler):
    """Collects what slapo's logger says (it does not propagate to the root logger)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def slapo_log():
    handler = _Messages()
    logger = slapo.get_logger()
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def test_the_defaults_are_the_reference_apis():
    params = inspect.signature(slapo.Verify).parameters
    assert list(params)[:5] == ["sch", "example_inputs", "device", "eval_mode", "enable"]
    assert params["device"].default == "cuda"
    assert params["eval_mode"].default is True
    assert params["enable"].default is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines with no GPU")
def test_the_cuda_default_falls_back_to_the_cpu_with_one_note(slapo_log):
    model = mlp()
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, torch.randn(5, 8)) as check:
        sch["1"].replace(nn.GELU())
    assert check.device == torch.device("cpu")
    notes = [line for line in slapo_log if "no CUDA GPU" in line]
    assert len(notes) == 1 and "comparing on the CPU" in notes[0], slapo_log
    assert model[0].weight.device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_cuda_default_runs_the_check_on_the_gpu_and_gives_the_model_back():
    model = mlp()
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, torch.randn(5, 8)) as check:
        sch["0"].checkpoint()
    assert check.device.type == "cuda"
    assert model[0].weight.device.type == "cpu"  # moved back where it was


def test_a_device_that_is_not_one_is_a_slapo_error():
    sch = slapo.create_schedule(mlp())
    with pytest.raises(slapo.SlapoError, match="device='gpu0'"):
        slapo.Verify(sch, torch.randn(5, 8), device="gpu0")


def test_eval_mode_compares_without_dropout_and_train_mode_with_it():
    x = torch.randn(5, 8)
    # Dropout and Identity agree in eval mode only: the default (eval_mode=True) passes...
    sch = slapo.create_schedule(mlp())
    with slapo.Verify(sch, x, device="cpu"):
        sch["2"].replace(nn.Identity())
    assert sch.mod.training  # the check leaves the model's mode alone
    # ...and train mode sees the dropout that is gone.
    sch = slapo.create_schedule(mlp())
    with pytest.raises(slapo.verify.VerificationError, match='replace.* on "2"'):
        with slapo.Verify(sch, x, device="cpu", eval_mode=False):
            sch["2"].replace(nn.Identity())


def test_enable_false_is_a_no_op_context(slapo_log):
    model = mlp()
    sch = slapo.create_schedule(model)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    with slapo.Verify(sch, torch.randn(5, 8), enable=False):
        sch["1"].replace(nn.ReLU())  # not equivalent: a check would raise
    assert calls == []  # nothing ran, on any device
    assert not [line for line in slapo_log if "Verify" in line]
    sch = slapo.create_schedule(mlp())
    with pytest.raises(slapo.verify.VerificationError):
        with slapo.Verify(sch, torch.randn(5, 8), enable=True):
            sch["1"].replace(nn.ReLU())
