"""``slapo.op.Print`` as Slapo code uses it: called in a model's forward with a message, a shape
and values, it stays a call in the fx graph and prints the real values when the built model
runs; the model computes what the unscheduled one does."""

from __future__ import annotations

import copy

import torch
from torch import fx, nn

import slapo
from graph_models import assert_same


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(8, 3)
        self.linear2 = nn.Linear(3, 8)
        self.print = slapo.op.Print()

    def forward(self, x):
        out = self.linear1(x)
        self.print(out, "linear1 shape\n", out.shape, "\nvalue\n", out)
        return self.linear2(out)


X = torch.randn(4, 8)


def test_print_stays_a_call_in_the_traced_graph_and_prints_at_run_time(capsys):
    torch.manual_seed(0)
    ref = Model()
    sch = slapo.create_schedule(copy.deepcopy(ref))
    capsys.readouterr()
    gm = sch.trace()  # fx, no inputs: Print is a leaf, not traced into
    assert "linear1 shape" not in capsys.readouterr().out  # nothing printed while tracing
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "print"]
    assert len(calls) == 1 and not calls[0].users
    gm.graph.eliminate_dead_code()  # an unused result, but a side effect: kept
    assert any(n.target == "print" for n in gm.graph.nodes)
    model, _ = slapo.build(sch)
    assert isinstance(model, fx.GraphModule)

    with torch.no_grad():
        expected = ref.linear1(X)
    capsys.readouterr()
    model(X)
    out = capsys.readouterr().out
    assert "linear1 shape\n torch.Size([4, 3]) \nvalue\n tensor([[" in out, out
    assert f"{expected[0, 0].item():.4f}" in out and f"{expected[3, 2].item():.4f}" in out, out
    assert out.count("tensor([[") == 1  # the first argument is returned, not printed
    assert_same(ref, model, X)


def test_print_survives_a_flattened_trace_and_prints_what_eager_prints(capsys):
    torch.manual_seed(0)
    ref = Model()
    sch = slapo.create_schedule(copy.deepcopy(ref))
    sch.trace(flatten=True)
    model, _ = slapo.build(sch)
    capsys.readouterr()
    ref(X)
    eager = capsys.readouterr().out
    model(X)
    assert capsys.readouterr().out == eager and "torch.Size([4, 3])" in eager
    assert_same(ref, model, X)


def test_print_returns_its_first_argument_whatever_follows(capsys):
    p = slapo.op.Print("tag")
    x = torch.ones(2, 3)
    assert p(x) is x  # the value alone: a summary goes to the log, nothing to stdout
    assert capsys.readouterr().out == ""
    assert p(x, x) is x
    assert p(x, "shape", x.shape) is x
    assert capsys.readouterr().out == f"tag {x}\ntag shape torch.Size([2, 3])\n"
