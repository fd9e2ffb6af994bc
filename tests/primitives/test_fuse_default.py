"""``fuse`` without a compiler, as Slapo code calls it: TorchScript where it scripts the
subgraph, else an eager fused module (noted in the log), never an error."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import fx

import slapo
from graph_models import MLP, assert_same

X = torch.randn(2, 5, 16)


def bias_gelu(x, bias):
    x = F.gelu(bias + x)
    return x


def scheduled_mlp() -> tuple[MLP, slapo.Schedule]:
    torch.manual_seed(0)
    ref = MLP()
    sch = slapo.create_schedule(copy.deepcopy(ref))
    sch["linear1"].decompose()
    sch.trace(flatten=True)
    return ref, sch


class Said(logging.Handler):
    """Collects what slapo's logger says (it does not propagate to the root logger)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def said():
    handler = Said()
    slapo.get_logger().addHandler(handler)
    yield handler.messages
    slapo.get_logger().removeHandler(handler)


def test_fuse_without_a_compiler_scripts_the_subgraph():
    ref, sch = scheduled_mlp()
    subgraph = sch.find(bias_gelu)
    assert sch.fuse(subgraph, name="BiasGeLU") == ["BiasGeLU_0"]
    assert isinstance(sch["BiasGeLU_0"].mod, torch.jit.ScriptModule)
    assert_same(ref, sch.mod, X)  # matmul + add and a scripted GELU: float32 tolerance


def test_fuse_without_a_compiler_stays_eager_where_torchscript_fails(monkeypatch, said):
    def refuse(obj, *args, **kwargs):
        raise RuntimeError("cannot script this")

    monkeypatch.setattr(torch.jit, "script", refuse)
    ref, sch = scheduled_mlp()
    assert sch.fuse(sch.find(bias_gelu), name="BiasGeLU") == ["BiasGeLU_0"]
    fused = sch["BiasGeLU_0"].mod
    assert isinstance(fused, fx.GraphModule) and not isinstance(fused, torch.jit.ScriptModule)
    assert any("runs eagerly" in m and "TorchScript cannot compile" in m for m in said), said
    assert_same(ref, sch.mod, X)  # matmul then add vs addmm: float32 tolerance
    # Asking for TorchScript by name still says that it failed.
    _, again = scheduled_mlp()
    with pytest.raises(slapo.PrimitiveError, match="TorchScript cannot compile"):
        again.fuse(again.find(bias_gelu), compiler="TorchScript")


def test_fuse_without_a_compiler_on_a_torch_without_torchscript(monkeypatch, said):
    monkeypatch.delattr(torch.jit, "script")
    ref, sch = scheduled_mlp()
    sch.fuse("default", sch.find(bias_gelu))  # "default" names the same fallback
    assert isinstance(sch["FusedModule_0"].mod, fx.GraphModule)
    assert any("no TorchScript" in m for m in said), said
    assert_same(ref, sch.mod, X)
