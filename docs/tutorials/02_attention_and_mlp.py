"""Tutorial 2: optimizing attention and an MLP on one device, with static-graph primitives.

What you learn:
  * ``trace`` turns ONE submodule into a static graph (a ``torch.fx.GraphModule``); the rest of
    the model stays eager. This is "trace by need": the static-graph primitives (``find``,
    ``fuse``, partial ``replace``) trace the module they are called on when it is not traced yet,
    and ``trace()`` does it explicitly, e.g. with options such as ``flatten=True``.
  * ``find`` locates subgraphs by a regex over submodule names or by a *pattern function*
    written in plain PyTorch.
  * Partial ``replace``: put a new module in place of a found subgraph, e.g. one fused q/k/v
    projection instead of three, or ``slapo.op.SDPAttention`` (torch's fused scaled-dot-product
    kernel) instead of the hand-written softmax attention.
  * ``decompose`` splits a Linear into matmul + bias add, so that the bias add can be ``fuse``-d
    with the GELU that follows into one compiled module.
  * The result has the same loss and gradients as the original model.

Run it: ``python docs/tutorials/02_attention_and_mlp.py``.
"""

import copy

import torch
import torch.nn.functional as F
from torch import fx, nn

import slapo
from slapo import op

torch.manual_seed(0)
HIDDEN, HEADS = 32, 4
SCALE = (HIDDEN // HEADS) ** -0.5  # 1 / sqrt(head_dim), as SDPA scales by default


# ---- 1. The model: a hand-written self-attention and an MLP, as in the Slapo paper. -------------
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN)
        self.out_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape

        def heads(t):  # (b, s, hidden) -> (b, heads, s, head_dim)
            return t.view(b, s, HEADS, HIDDEN // HEADS).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        probs = torch.softmax(q @ k.transpose(-1, -2) * SCALE, dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, s, HIDDEN)
        return self.out_proj(out)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


reference = Layer()
model = copy.deepcopy(reference)
sch = slapo.create_schedule(model)


# ---- 2. Fuse the q/k/v projections: find the three Linears, replace them with one. -----------
class FusedQKV(nn.Module):
    """One matmul for q, k and v (a bigger GEMM uses the hardware better than three small ones)."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.cat([q.weight, k.weight, v.weight]).detach().clone())
        self.bias = nn.Parameter(torch.cat([q.bias, k.bias, v.bias]).detach().clone())

    def forward(self, x):
        return F.linear(x, self.weight, self.bias).chunk(3, dim=-1)  # (q, k, v)


attn = sch["attn"]
qkv = attn.find(r"[qkv]_proj")  # a regex over submodule names: three one-node subgraphs
# find needed a graph, so it traced "attn" (and only it): "mlp" is still an ordinary module.
assert isinstance(attn.mod, fx.GraphModule) and not isinstance(sch["mlp"].mod, fx.GraphModule)
print("found:", [s.output.target for s in qkv])
# The new module is registered as "qkv_0" (a second one would be "qkv_1"), as Slapo names it.
attn.replace(FusedQKV(model.attn.q_proj, model.attn.k_proj, model.attn.v_proj), qkv, name="qkv")
print("attn's children now:", list(attn.child))


# ---- 3. Replace the softmax attention core with slapo.op's fused attention. ---------------------
def attention_core(q, k, v):  # a pattern: plain PyTorch code, matched against the graph
    return torch.softmax(q @ k.transpose(-1, -2) * SCALE, dim=-1) @ v


core = attn.find(attention_core)
assert len(core) == 1, core
# The subgraph's inputs follow the pattern's arguments, so SDPAttention gets (q, k, v).
attn.replace(op.SDPAttention(impl="sdpa"), core, name="core")
print("attention graph after both replacements:")
print(attn.mod.code)

# ---- 4. The MLP: decompose fc1, trace, find "gelu(bias + x)", fuse it into one module. ----------
sch["mlp.fc1"].decompose()  # Linear -> matmul, then bias add: exposes the add to the graph
sch["mlp"].trace(flatten=True)  # flatten: trace through fc1 into its matmul and add
bias_gelu = sch["mlp"].find(lambda x, bias: F.gelu(bias + x))
print("bias+GELU subgraph:", [node.name for _, node in bias_gelu[0]])  # (path, node) pairs
# The compiler turns the fused module into one kernel: "TorchScript" here; "inductor" (torch.compile)
# needs a C++ toolchain on CPU; None keeps the fused module eager.
sch["mlp"].fuse("TorchScript", bias_gelu, name="BiasGeLU")
print(sch)

# ---- 5. Check: the same loss and the same gradients as the unscheduled model. -------------------
x = torch.randn(2, 8, HIDDEN)
ref_loss = reference(x).pow(2).mean()
ref_loss.backward()
loss = model(x).pow(2).mean()
loss.backward()
print(f"loss: scheduled {loss.item():.6f}   original {ref_loss.item():.6f}")
# Other kernels (one GEMM for q/k/v, SDPA, matmul + add) sum in another order: float32 tolerance.
torch.testing.assert_close(loss, ref_loss)
ref_params = dict(reference.named_parameters())
got = dict(model.named_parameters())
# Every gradient of the original: the fused projection's are the q, k and v gradients stacked.
for name, ref in ref_params.items():
    if name.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
        kind = name.rsplit(".", 1)[1]  # weight or bias
        grad = got[f"attn.qkv_0.{kind}"].grad.chunk(3)["qkv".index(name.split(".")[1][0])]
    else:
        grad = got[name].grad  # the other parameters kept their names
    torch.testing.assert_close(grad, ref.grad, msg=lambda m, n=name: f"{n}: {m}")
print("OK: same loss and gradients after fusing q/k/v, SDPA and bias+GELU")
