"""find matches structurally; fuse turns a match into one module without changing numerics."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import slapo
from graph_models import MLP, Attention, assert_same
from slapo.pattern import ModulePattern, Pattern, Subgraph, call_module


def seed_mlp(tracer: str, decompose: bool = True):
    torch.manual_seed(0)
    ref = MLP()
    model = MLP()
    model.load_state_dict(ref.state_dict())
    sch = slapo.create_schedule(model)
    if decompose:
        sch["linear1"].decompose()
    x = torch.randn(2, 5, 16)
    sch.trace(flatten=True, tracer=tracer, example_inputs=x if tracer == "export" else None)
    return ref, sch, x


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_issue_example_decompose_find_fuse_keeps_loss_and_grads(tracer):
    ref, sch, x = seed_mlp(tracer)
    subgraph = sch.find(lambda x, bias: F.gelu(bias + x))
    assert len(subgraph) == 1 and len(subgraph[0]) == 2
    names = sch.fuse(subgraph, compiler=None, name="BiasGeLU")
    assert names == ["BiasGeLU_0"] and isinstance(sch["BiasGeLU_0"].mod, fx.GraphModule)
    assert sorted(sch.mod.state_dict()) == sorted(ref.state_dict())
    assert_same(ref, sch.mod, x)  # decomposed matmul + add vs Linear's addmm: float32 tolerance


def test_matching_is_commutative_and_returns_every_match():
    class Twice(nn.Module):
        def forward(self, x, y):
            a = torch.relu(x + y)
            b = torch.relu(y + a)  # the same pattern, operands swapped
            return a * b

    gm = slapo.create_schedule(Twice())
    gm.trace(tracer="fx")
    found = gm.find(lambda p, q: torch.relu(q + p))
    assert len(found) == 2
    assert all(isinstance(s, Subgraph) and s.nodes[0].name.startswith("add") for s in found)
    # Found in graph order; the inputs follow the pattern's arguments.
    assert found[0].inputs[1].name == "x" or found[0].inputs[0].name == "x"


def test_pattern_classes_module_patterns_and_call_module():
    sch = slapo.create_schedule(MLP())
    sch.trace(tracer="fx")

    class LinearGelu(Pattern):
        def forward(self, x):
            return F.gelu(call_module(r"linear\d", x))

    assert len(sch.find(LinearGelu)) == 1
    assert len(sch.find(LinearGelu())) == 1
    assert [s.output.target for s in sch.find(ModulePattern(r"linear\d"))] == [
        "linear1",
        "linear2",
    ]
    assert [s.output.target for s in sch.find(r"linear2")] == ["linear2"]
    assert sch.find(lambda x: torch.tanh(x)) == []  # no match: empty


def test_find_searches_traced_children_and_reports_their_path():
    sch = slapo.create_schedule(nn.Sequential(Attention(), nn.ReLU()))
    sch.trace(tracer="fx")
    qkv = sch.find(r"[qkv]_proj")
    assert [s.path for s in qkv] == ["0", "0", "0"]


def test_fuse_of_an_empty_match_warns_and_changes_nothing():
    ref, sch, x = seed_mlp("fx")
    code = sch.mod.code
    with pytest.warns(UserWarning, match="empty match"):
        assert sch.fuse(sch.find(lambda x: torch.tanh(x)), compiler=None) == []
    with pytest.warns(UserWarning, match="empty match"):
        sch.replace(nn.Identity(), [])
    assert sch.mod.code == code


def test_fusing_a_subgraph_whose_intermediate_escapes_is_an_error():
    class Escape(nn.Module):
        def forward(self, x, b):
            y = x + b
            return F.gelu(y) * y  # y is used outside gelu(x + b)

    sch = slapo.create_schedule(Escape())
    sch.trace(tracer="fx")
    found = sch.find(lambda x, b: F.gelu(x + b))
    with pytest.raises(slapo.PrimitiveError, match="escapes"):
        sch.fuse(found, compiler=None)


def test_find_on_a_module_wrapped_before_tracing_says_what_to_do():
    # find traces by need (tests/tracing/test_trace_by_need.py); a wrapped forward cannot be.
    sch = slapo.create_schedule(MLP())
    sch.checkpoint()
    with pytest.raises(slapo.SlapoError, match=r'find on "<root>" needs a static graph.*before'):
        sch.find(r"linear1")


def test_fuse_with_inductor_keeps_loss_and_grads():
    ref, sch, x = seed_mlp("fx")
    ref.eval()  # compiled code draws dropout masks differently: compare without dropout
    sch.mod.eval()
    sch.fuse(sch.find(lambda x, bias: F.gelu(bias + x)), compiler="inductor", name="BiasGeLU")
    assert_same(ref, sch.mod, x, exact=False)


def test_fuse_with_torchscript_works_or_says_why():
    ref, sch, x = seed_mlp("fx")
    found = sch.find(lambda x, bias: F.gelu(bias + x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            sch.fuse(found, compiler="TorchScript", name="BiasGeLU")
        except slapo.PrimitiveError as exc:
            assert "TorchScript" in str(exc)
            return
    assert_same(ref, sch.mod, x, exact=False)


def test_a_bad_regex_is_a_primitive_error_naming_the_path_and_the_pattern():
    _, sch, _ = seed_mlp("fx", decompose=False)
    outer = slapo.create_schedule(nn.Sequential(MLP()))
    outer.trace(tracer="fx")
    for where, s in (("<root>", sch), ("0", outer["0"])):
        with pytest.raises(slapo.PrimitiveError, match=rf'find on "{where}": \'fc\[\' is not a va'):
            s.find("fc[")
    # The regexes of call_module() and ModulePattern are checked too, even with nothing to match.
    with pytest.raises(slapo.PrimitiveError, match=r"'lin\(' is not a valid regular expression"):
        sch.find(lambda x: F.relu(call_module("lin(", x)))
    with pytest.raises(slapo.PrimitiveError, match=r"'\*' is not a valid regular expression"):
        sch.find(ModulePattern("*"))
