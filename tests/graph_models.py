"""The seed's MLP and attention examples and the step oracle of the static-graph tests.

A module of its own (not conftest.py): test directories run together each have a ``conftest``,
and only one of them can be imported under that name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """The seed's MLP: linear, GELU, linear, dropout."""

    def __init__(self, hidden: int = 16, dropout: float = 0.1) -> None:
        super().__init__()
        self.linear1 = nn.Linear(hidden, 4 * hidden)
        self.linear2 = nn.Linear(4 * hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.linear2(F.gelu(self.linear1(x))))


class Attention(nn.Module):
    """The seed's self-attention: separate q/k/v projections, softmax attention, dropout."""

    def __init__(self, hidden: int = 16, heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        probs = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, dim=-1)
        probs = F.dropout(probs, self.dropout, self.training)
        out = (probs @ v).transpose(1, 2).reshape(b, s, h)
        return self.out_proj(out)


class FusedQKV(nn.Module):
    """One matmul for q, k and v; returns the three projections."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.cat([q.weight, k.weight, v.weight]).detach().clone())
        bias = [m.bias for m in (q, k, v)]
        self.bias = nn.Parameter(torch.cat(bias).detach().clone()) if bias[0] is not None else None
        self.sizes = [q.out_features, k.out_features, v.out_features]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))


def step(model: nn.Module, x: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, dict]:
    """Loss (sum of outputs) and gradients of one step, under a fixed seed."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x)
    loss = (out[0] if isinstance(out, tuple) else out).pow(2).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same(ref: nn.Module, test: nn.Module, x: torch.Tensor, exact: bool = False) -> None:
    """Same loss and every gradient: float32 tolerance, or bit-identity with ``exact=True``.

    A caller passing ``exact=True`` says why no CPU and no thread count can reorder the float
    operations (see ``hf_models.assert_same_step``).
    """
    loss_ref, g_ref = step(ref, x)
    loss_test, g_test = step(test, x)
    kw = {"rtol": 0, "atol": 0} if exact else {}  # {}: float32 defaults (rtol 1.3e-6, atol 1e-5)
    torch.testing.assert_close(loss_test, loss_ref, **kw)
    assert set(g_ref) == set(g_test), set(g_ref) ^ set(g_test)
    for name, grad in g_ref.items():
        torch.testing.assert_close(g_test[name], grad, **kw, msg=lambda m, n=name: f"{n}: {m}")
