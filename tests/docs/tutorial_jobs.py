"""The multi-device MLP tutorial's model and per-rank job, for tests/docs/test_slapo_tutorials.py:
kept apart from the test module so that the spawned gloo workers do not import transformers."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import slapo

HIDDEN, HEADS = 32, 4


def bias_gelu_pattern(x, bias):
    x = F.gelu(bias + x)
    return x


class MLP(nn.Module):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.linear1 = nn.Linear(hidden, 4 * hidden)
        self.activation = nn.GELU()
        self.linear2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.linear2(self.activation(self.linear1(x)))


def tensor_parallel_mlp_job(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    reference = MLP()
    x = torch.randn(4, 8, HIDDEN, requires_grad=True)
    ref_loss = reference(x).pow(2).mean()
    ref_loss.backward()

    sch = slapo.create_schedule(copy.deepcopy(reference))
    assert (sch.rank, sch.world_size) == (rank, world)
    sch["linear1"].shard("weight", axis=0)
    sch["linear1"].shard("bias", axis=0)
    sch["linear1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["linear2"].shard("weight", axis=1)
    sch["linear2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["linear1"].decompose()
    sch.trace(flatten=True)
    subgraph = sch.find(bias_gelu_pattern)
    assert len(subgraph) == 1 and len(subgraph[0]) == 2
    sch.fuse(subgraph, compiler="TorchScript", name="BiasGeLU")
    model, _ = slapo.build(sch, init_weights=False)

    xs = x.detach().clone().requires_grad_()
    loss = model(xs).pow(2).mean()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(xs.grad, x.grad)  # linear1's backward all-reduce ran
    part = 4 * HIDDEN // world
    mine = slice(rank * part, (rank + 1) * part)
    expected = {
        "linear1.weight": reference.linear1.weight.grad[mine],
        "linear1.bias": reference.linear1.bias.grad[mine],
        "linear2.weight": reference.linear2.weight.grad[:, mine],
        "linear2.bias": reference.linear2.bias.grad,
    }
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name].grad, grad, msg=lambda m, n=name: f"{n}: {m}")
    return [n.target if n.op == "call_module" else n.name for n in model.graph.nodes]
