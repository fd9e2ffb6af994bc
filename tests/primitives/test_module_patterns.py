"""Patterns written as Slapo code writes them: ``slapo.Pattern`` subclasses with submodules
(matched by module type, any sizes), functional and module forms of one op, horizontal
(several outputs), two-path and diamond patterns, ``call_module`` by class name, and
``sch.get_module``. Every scheduled model still computes what the unscheduled one does."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slapo
from graph_models import Attention, FusedQKV, step
from slapo.pattern import call_module


class LeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(120, 84)
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = self.relu1(self.fc1(x))
        x = self.relu2(self.fc2(x))
        return self.fc3(x)


class LinearReLUPattern(slapo.Pattern):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 10)  # the sizes do not matter: the type does
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.linear(x))


IMAGES = torch.randn(2, 1, 28, 28)


def param_names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {p: n for n, p in model.named_parameters()}


def assert_same_fused(
    ref: nn.Module, test: nn.Module, x: torch.Tensor, before: dict[nn.Parameter, str]
) -> None:
    """Same loss and gradients; ``fuse`` moves the modules a match calls into the fused module
    (``fc1.weight`` becomes ``LinearReLU_0.0.weight``), so each gradient is compared under the
    name its parameter had ``before`` the fuse."""
    loss_ref, g_ref = step(ref, x)
    loss, g = step(test, x)
    now = dict(test.named_parameters())
    g = {before[now[n]]: grad for n, grad in g.items()}
    torch.testing.assert_close(loss, loss_ref)
    assert set(g) == set(g_ref), set(g) ^ set(g_ref)
    for name, grad in g_ref.items():
        torch.testing.assert_close(g[name], grad, msg=lambda m, n=name: f"{n}: {m}")


def lenet() -> tuple[LeNet, slapo.Schedule]:
    torch.manual_seed(0)
    ref = LeNet()
    return ref, slapo.create_schedule(copy.deepcopy(ref))


def test_a_pattern_with_submodules_finds_both_linear_relu_pairs_of_lenet():
    ref, sch = lenet()
    sch.trace()
    subgraphs = sch.find(LinearReLUPattern())
    assert [[n.target for _, n in s] for s in subgraphs] == [["fc1", "relu1"], ["fc2", "relu2"]]
    assert len(sch.find(LinearReLUPattern)) == 2  # the class works too
    # Slapo code reads the modules off the matched nodes.
    linears = [sch.get_module(s[0][1].target) for s in subgraphs]
    assert linears == [sch.mod.fc1, sch.mod.fc2]
    assert sch.get_module(subgraphs[1][1]) is sch.mod.relu2  # a (path, node) pair
    before = param_names(sch.mod)
    names = sch.fuse(subgraphs, compiler=None, name="LinearReLU")
    assert names == ["LinearReLU_0", "LinearReLU_1"]
    assert_same_fused(ref, sch.mod, IMAGES, before)  # the same modules, called from a fused graph


def test_a_functional_pattern_and_a_module_pattern_match_each_other():
    class Acts(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.act = nn.ReLU()

        def forward(self, x):
            a = self.act(self.fc(x))  # module
            b = F.relu(self.fc(a))  # functional
            c = torch.relu(self.fc(b))  # torch function
            return self.fc(c).relu()  # tensor method

    class ReLUModule(slapo.Pattern):
        def __init__(self):
            super().__init__()
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(x)

    sch = slapo.create_schedule(Acts())
    by_module = sch.find(ReLUModule())
    assert [s.output.name for s in by_module] == ["act", "relu", "relu_1", "relu_2"]
    for pattern in (lambda x: F.relu(x), lambda x: torch.relu(x), lambda x: x.relu()):
        assert [s.output for s in sch.find(pattern)] == [s.output for s in by_module]
    # A module pattern chained to a functional op in the model: Linear then relu, four times.
    assert len(sch.find(LinearReLUPattern())) == 4


class ConvBNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(x))).mean(dim=(2, 3))


class BNReLU(slapo.Pattern):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(1)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(x))


def test_a_batchnorm_relu_pattern_traces_and_matches_both_forms():
    torch.manual_seed(0)
    ref = ConvBNNet()
    sch = slapo.create_schedule(copy.deepcopy(ref))
    subgraphs = sch.find(BNReLU())
    assert [[n.name for n in s.nodes] for s in subgraphs] == [["bn1", "relu"], ["bn2", "relu_1"]]
    before = param_names(sch.mod)
    sch.fuse(subgraphs, compiler=None, name="BNReLU")
    # Training-mode batch norm in both models: the same statistics, the same gradients.
    assert_same_fused(ref, sch.mod, torch.randn(2, 3, 6, 6), before)
    bn1 = sch.get_module("BNReLU_0.0")  # the fused module's children: "0", "1", ...
    torch.testing.assert_close(bn1.running_mean, ref.bn1.running_mean)


def test_a_horizontal_pattern_matches_the_qkv_projections_of_one_input():
    class QKV(slapo.Pattern):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)

        def forward(self, x):
            return self.q(x), self.k(x), self.v(x)

    torch.manual_seed(0)
    ref = Attention()
    sch = slapo.create_schedule(copy.deepcopy(ref))
    subgraphs = sch.find(QKV())
    assert len(subgraphs) == 1  # out_proj reads another input: not a fourth branch
    match = subgraphs[0]
    assert [n.target for n in match.outputs] == ["q_proj", "k_proj", "v_proj"]
    assert match.output is match.outputs[0] and len(match.inputs) == 1
    q, k, v = (sch.get_module(n) for n in match.outputs)
    assert sch.replace(FusedQKV(q, k, v), match, name="FusedQKV") == "FusedQKV_0"
    x = torch.randn(2, 5, 16)
    loss_ref, g_ref = step(ref, x)
    loss, g = step(sch.mod, x)
    torch.testing.assert_close(loss, loss_ref)  # one matmul instead of three: float32 tolerance
    for kind in ("weight", "bias"):
        stacked = torch.cat([g_ref[f"{p}_proj.{kind}"] for p in "qkv"])
        torch.testing.assert_close(g[f"FusedQKV_0.{kind}"], stacked)


class Paths(nn.Module):
    """A diamond (one value, two uses, joined) and two paths of one input joined."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 8)
        self.up = nn.Linear(8, 8)
        self.down = nn.Linear(8, 8)

    def forward(self, x):
        h = self.gate(x)
        x = torch.sigmoid(h) * h  # diamond: h feeds sigmoid and the mul
        return F.relu(self.up(x)) + torch.tanh(self.down(x))  # two paths from x, joined


def test_diamond_and_two_path_patterns_match_and_fuse():
    def diamond(h):
        return torch.sigmoid(h) * h

    class TwoPath(slapo.Pattern):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(1, 1), nn.Linear(1, 1)

        def forward(self, x):
            return F.relu(self.a(x)) + torch.tanh(self.b(x))

    torch.manual_seed(0)
    ref = Paths()
    sch = slapo.create_schedule(copy.deepcopy(ref))
    found = sch.find(diamond)
    assert len(found) == 1 and [n.name for n in found[0].nodes] == ["sigmoid", "mul"]
    assert found[0].inputs[0].name == "gate"
    two = sch.find(TwoPath())
    assert len(two) == 1 and [n.name for n in two[0].nodes] == ["up", "relu", "down", "tanh", "add"]
    before = param_names(sch.mod)
    sch.fuse(found, compiler="TorchScript", name="Swish")
    sch.fuse(sch.find(TwoPath()), compiler=None, name="TwoPath")
    assert {"Swish_0", "TwoPath_0"} <= set(sch.child)
    assert_same_fused(ref, sch.mod, torch.randn(3, 8), before)  # scripted sigmoid-mul: f32 tol.


def test_call_module_matches_module_calls_by_class_name():
    _, sch = lenet()
    relus = sch.find(lambda x: call_module("ReLU", x))
    assert [s.output.target for s in relus] == ["relu1", "relu2"]  # F.relu is no module call
    pairs = sch.find(lambda x: call_module("ReLU", call_module("Linear", x)))
    assert [[n.target for _, n in s] for s in pairs] == [["fc1", "relu1"], ["fc2", "relu2"]]
    assert [s[0][1].target for s in sch.find("Conv2d")] == ["conv1", "conv2"]
    assert [s[0][1].target for s in sch.find(r"fc\d")] == ["fc1", "fc2", "fc3"]  # names still


def test_get_module_resolves_paths_nodes_and_matches_in_traced_children():
    sch = slapo.create_schedule(nn.Sequential(Attention()))
    sch.trace(tracer="fx")  # the Attention becomes a child GraphModule "0"
    found = sch.find(r"q_proj")
    assert found[0][0][0] == "0"
    q_proj = sch.mod.get_submodule("0.q_proj")
    assert sch.get_module(found[0][0]) is q_proj  # a (path, node) pair: relative to "0"
    assert sch["0"].get_module(found[0][0][1]) is q_proj
    assert sch.get_module("0.k_proj") is sch.mod.get_submodule("0.k_proj")
    with pytest.raises(slapo.SchedulePathError, match="no submodule"):
        sch.get_module("0.w_proj")
    add = next(n for n in sch["0"].mod.graph.nodes if n.op == "call_function")
    with pytest.raises(slapo.PrimitiveError, match="only call_module nodes"):
        sch["0"].get_module(add)


def test_a_pattern_must_return_operations():
    _, sch = lenet()
    with pytest.raises(slapo.SlapoError, match="must return the result of an operation"):
        sch.find(lambda x: (x, torch.relu(x)))


def test_a_user_module_in_a_pattern_matches_its_traced_child_by_class():
    class Block(nn.Module):
        def __init__(self, width: int = 8):
            super().__init__()
            self.fc = nn.Linear(width, width)

        def forward(self, x):
            return torch.tanh(self.fc(x))

    class BlockNorm(slapo.Pattern):
        def __init__(self):
            super().__init__()
            self.block = Block(1)
            self.norm = nn.LayerNorm(1)

        def forward(self, x):
            return self.norm(self.block(x))

    sch = slapo.create_schedule(nn.Sequential(Block(), nn.LayerNorm(8), Block()))
    sch.trace()  # the Blocks become child GraphModules named "Block"
    assert isinstance(sch["0"].mod, torch.fx.GraphModule)
    found = sch.find(BlockNorm())
    assert [[n.target for n in s.nodes] for s in found] == [["0", "1"]]
