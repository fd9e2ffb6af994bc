"""Tutorial 1: quick start, from a plain PyTorch model to a scheduled one that trains.

What you learn:
  * ``slapo.create_schedule(model)`` gives a *schedule*: a tree that mirrors the model's modules;
    ``sch["layers.0.mlp"]`` is the schedule of that submodule, ``.mod`` the module itself.
  * Dynamic-graph primitives change how a submodule runs without touching the model's code:
    ``replace`` (swap a module), ``checkpoint`` (recompute activations in backward) and
    ``annotate`` (tag a parameter). None of them needs a traced graph.
  * ``slapo.build(sch, optimizer=...)`` returns ``(model, optimizer)``; ``slapo.train_step`` runs
    one forward and backward with the same loop for every build target.
  * ``slapo.Verify`` checks that the primitives applied inside its block keep outputs and
    gradients; and the scheduled model trains like the original: we compare the loss curves.

Run it: ``python docs/tutorials/01_quick_start.py`` (a few seconds on a CPU).
"""

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

import slapo

torch.manual_seed(0)


# ---- 1. An ordinary PyTorch model: nothing in it knows about Slapo. ------------------------------
class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class ErfGELU(nn.Module):
    """Our "optimized" activation: GELU written out with erf (the same function as nn.GELU)."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


reference = TinyLM()
model = copy.deepcopy(reference)  # the same weights: the reference stays unscheduled

# ---- 2. The schedule: a tree with the model's structure. ----------------------------------------
sch = slapo.create_schedule(model)
print(sch)  # every submodule, by its dotted path
print("layers.0.mlp is", type(sch["layers.0.mlp"].mod).__name__)
assert sch["layers.0.mlp.fc1"].mod is model.layers[0].mlp.fc1  # the real module, not a copy

# ---- 3. Dynamic-graph primitives: applied directly to modules, no tracing. ----------------------
# slapo.Verify runs the model before and after the block on an example input and checks, on exit,
# that outputs and all gradients still match; a mismatch names the first primitive that broke it.
with slapo.Verify(sch, torch.randint(0, 64, (2, 8)), device="cpu"):
    for i in range(2):
        sch[f"layers.{i}.mlp.act"].replace(ErfGELU())  # swap the activation in every block
    sch["layers.1"].checkpoint()  # recompute layer 1's activations in backward (saves memory)
    sch["head"].annotate("weight", "note", "output projection")  # any key/value on a parameter
print(sch)  # the tree now lists the primitives applied

# ---- 4. Build: (model, optimizer), ready for the ordinary training loop. ------------------------
built, optimizer = slapo.build(sch, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5})
assert built.head.weight.note == "output projection"  # the annotation survived build
assert isinstance(built.layers[0].mlp.act, ErfGELU)
# The parameter names did not change: a state dict saved before scheduling still loads.
assert built.state_dict().keys() == reference.state_dict().keys()


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


# ---- 5. Train both models on the same batches and compare the loss curves. ----------------------
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
data = torch.Generator().manual_seed(1)
ours, theirs = [], []
for step in range(8):
    ids = torch.randint(0, 64, (4, 16), generator=data)
    batch = (ids[:, :-1], ids[:, 1:])  # (inputs, target): the target is the tuple's last item

    loss = slapo.train_step(built, batch, loss_fn=loss_fn)  # forward + backward
    optimizer.step()
    optimizer.zero_grad()
    ours.append(loss.item())

    ref_loss = loss_fn(reference(batch[0]), batch[1])  # the plain PyTorch loop
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    theirs.append(ref_loss.item())
    print(f"step {step}: scheduled {ours[-1]:.5f}   original {theirs[-1]:.5f}")

# erf-GELU and nn.GELU round differently in the last bit, so the curves agree to float32
# tolerance (not bit for bit); checkpointing itself changes nothing.
torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs))
for name, p in reference.named_parameters():
    torch.testing.assert_close(built.get_parameter(name), p, msg=lambda m, n=name: f"{n}: {m}")
assert ours[-1] < ours[0], "the loss goes down"
print("OK: the scheduled model trains like the original")
