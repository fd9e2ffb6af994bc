"""Tutorial 4: looking inside a traced module with ``slapo.op.Print``.

What you learn:
  * A traced module is a ``torch.fx.GraphModule``: ``sch[path].mod.code`` shows the code that
    runs, one line per op, so you see exactly what a schedule did to it.
  * ``slapo.op.Print(tag, stats=True)`` is a pass-through module that logs the shape, dtype and
    mean of what flows through it (to the "Slapo" logger) and returns its input unchanged.
  * To watch an intermediate value, ``find`` the op that makes it and ``replace`` the match with
    the same op followed by ``Print``: the model computes the same thing, and tells you about it.
    The model's code is untouched; drop the two lines from the schedule and the probe is gone.

Run it: ``python docs/tutorials/04_debug_with_print.py``.
"""

import copy
import logging

import torch
from torch import nn

import slapo
from slapo import op

torch.manual_seed(0)


class Attention(nn.Module):
    """Self-attention with separate q/k/v projections (hidden 16, 4 heads)."""

    def __init__(self, hidden: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape

        def split(t):
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        probs = torch.softmax(q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5, dim=-1)
        return self.out_proj((probs @ v).transpose(1, 2).reshape(b, s, h))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.attn(x))


reference = Model()
model = copy.deepcopy(reference)
sch = slapo.create_schedule(model)

# ---- 1. Trace only the attention and read its graph. --------------------------------------------
sch["attn"].trace()  # no example inputs needed: torch.fx traces it symbolically
print("the traced attention runs:")
print(sch["attn"].mod.code)

# ---- 2. Probe the attention probabilities: softmax, then Print. ---------------------------------
found = sch["attn"].find(lambda scores: torch.softmax(scores, dim=-1))
assert len(found) == 1
probe = nn.Sequential(nn.Softmax(dim=-1), op.Print("attention probs", stats=True))
sch["attn"].replace(probe, found, name="softmax_probe")

# ---- 3. Probe the input of the output projection: Print, then the very same Linear. -------------
# Print returns what it gets, so it can sit in front of any module. Note that the Linear's
# parameter names now go through the probe ("out_proj_probe_0.1.weight"): fine while debugging.
found = sch["attn"].find(r"out_proj")
sch["attn"].replace(
    nn.Sequential(op.Print("out_proj input"), model.attn.out_proj), found, name="out_proj_probe"
)
print(sch["attn"].mod.code)  # the two probes are in the graph now

# ---- 4. Run it and collect what Print logged. ---------------------------------------------------
lines = []  # the messages of the Print modules


class Collect(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("[Print"):
            lines.append(record.getMessage())


logging.getLogger("Slapo").addHandler(Collect())  # Print logs to the "Slapo" logger (stderr)
x = torch.randn(2, 8, 16)
out = model(x)
for line in lines:
    print("logged:", line)

# What the probes tell us: 2 x 4 heads x 8 x 8 probabilities; every row sums to one, so their mean
# is exactly 1/8 — a quick sanity check of the masking and the softmax axis.
assert lines[0].startswith("[Print attention probs] Tensor(2, 4, 8, 8) torch.float32"), lines
assert "mean=0.125" in lines[0], lines[0]
assert lines[1] == "[Print out_proj input] Tensor(2, 8, 16) torch.float32", lines

# ---- 5. The probes change nothing: same output, same gradients as the original. -----------------
out.sum().backward()
ref_out = reference(x)
ref_out.sum().backward()
# The same ops in the same order on the same operands: bit for bit on any CPU.
torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
torch.testing.assert_close(
    model.attn.out_proj_probe_0[1].weight.grad, reference.attn.out_proj.weight.grad, rtol=0, atol=0
)
torch.testing.assert_close(
    model.attn.q_proj.weight.grad, reference.attn.q_proj.weight.grad, rtol=0, atol=0
)
print("OK: Print showed the intermediate values and changed nothing")
