"""A script written from the seed documents alone (seeds 000, 001, 003) runs unchanged.

Nothing here uses a name or an argument order that only this implementation has: the schedule
tree, dynamic primitives, ``trace()`` with no inputs, ``find`` by regex and by pattern function on
a module nobody traced, ``replace`` of the found subgraph, ``decompose``, ``fuse`` in both argument
orders, ``Verify``, and ``build``. (The pipeline build from the same documents runs in
``docs/tutorials/05_pipeline_stages.py``, tested in ``tests/docs``.)
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import slapo


class MLP(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class BiasGeLU(nn.Module):
    """What the found ``gelu(x + bias)`` subgraph is replaced with."""

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.gelu(x + bias)


def loss_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_script_from_the_seed_documents_runs_and_keeps_the_model():
    torch.manual_seed(0)
    ref = Model()
    model = copy.deepcopy(ref)
    x = torch.randn(4, 8, 16)

    sch = slapo.create_schedule(model)
    assert sch["layers.0.mlp.fc1"].mod is model.layers[0].mlp.fc1  # the tree mirrors the model

    with slapo.Verify(sch, [x], device="cpu"):
        # dynamic primitives: no tracing
        sch["layers.0"].checkpoint()
        sch["layers.1.mlp.fc1"].annotate("weight", "note", "seed")
        # static-graph primitives: find by regex traces the block by need
        assert sch["layers.0.mlp"].find(r"fc\d")  # a regex over the module's call nodes
        sub = sch["layers.1.mlp"]
        sub["fc1"].decompose()  # fc1 -> matmul + bias add
        sub.trace(flatten=True)  # a plain module: traced with no example inputs
        found = sub.find(lambda x, bias: F.gelu(bias + x))  # by pattern function
        assert len(found) == 1
        sub.replace(BiasGeLU(), found)
        # fuse, in the seed's order (compiler first) and with the keyword
        blk = sch["layers.2.mlp"]
        blk["fc1"].decompose()
        blk.trace(flatten=True)
        blk.fuse("TorchScript", blk.find(lambda x, bias: F.gelu(bias + x)))
        last = sch["layers.3.mlp"]
        last["fc1"].decompose()
        last.trace(flatten=True)
        last.fuse(last.find(lambda x, bias: F.gelu(bias + x)), compiler=None)  # keyword order

    built, optimizer = slapo.build(sch, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
    loss_ref, grads_ref = loss_and_grads(ref, x)
    loss, grads = loss_and_grads(built, x)
    # float32 tolerance: decompose and fusion change the float op sequence
    torch.testing.assert_close(loss, loss_ref)
    assert set(grads) == set(grads_ref)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, msg=lambda m, n=name: f"{n}: {m}")
    optimizer.step()
    assert not torch.equal(built.layers[0].mlp.fc1.weight, ref.layers[0].mlp.fc1.weight)
