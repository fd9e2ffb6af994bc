"""Slapo's ready ops run unchanged: ``slapo.op.FusedMLP`` equals the plain two-Linear MLP given
the same weights, and ``slapo.op.attention.FlashAttentionOp`` (SDPA on CPU) equals eager
attention, ``softmax(QK^T / sqrt(d) + causal mask) V``; losses and gradients alike."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slapo
from slapo.op.attention import FlashAttentionOp


class PlainMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act, bias: bool) -> None:
        super().__init__()
        self.fc_in = nn.Linear(hidden, inter, bias=bias)
        self.fc_out = nn.Linear(inter, hidden, bias=bias)
        self.act = act

    def forward(self, x):
        return self.fc_out(self.act(self.fc_in(x)))


ACTS = {
    "gelu": nn.GELU(),
    "gelu_new": nn.GELU(approximate="tanh"),
    "relu": nn.ReLU(),
    "silu": nn.SiLU(),
}


def _grads(mod: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in mod.named_parameters()}


@pytest.mark.parametrize(
    ("activation", "bias", "compiler"),
    [
        ("gelu", True, None),
        ("gelu_new", True, "eager"),
        ("relu", False, None),
        ("silu", True, None),
    ],
)
def test_fused_mlp_equals_plain_mlp(activation: str, bias: bool, compiler: str | None) -> None:
    torch.manual_seed(0)
    ref = PlainMLP(16, 64, ACTS[activation], bias)
    mlp = slapo.op.FusedMLP(16, 64, activation=activation, bias=bias, compiler=compiler)
    mlp.load_state_dict(ref.state_dict())
    x, target = torch.randn(4, 5, 16), torch.randn(4, 5, 16)
    loss, ref_loss = F.mse_loss(mlp(x), target), F.mse_loss(ref(x), target)
    torch.testing.assert_close(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(_grads(mlp), _grads(ref))


def test_fused_mlp_dropout_follows_mode() -> None:
    mlp = slapo.op.FusedMLP(8, 16, dropout=0.5, compiler=None)
    x = torch.randn(64, 8)
    assert torch.equal(mlp.eval()(x), mlp(x))
    assert (mlp.train()(x) == 0).any()
    with pytest.raises(slapo.SlapoError, match="activation"):
        slapo.op.FusedMLP(8, 16, activation="tanhh")


def _eager_attention(q, k, v, causal: bool):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        mask = torch.full((n, n), float("-inf")).triu(1)
        scores = scores + mask
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("name", ["cuda", "triton", "native_xformers", "auto", "sdpa"])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_op_equals_eager(name: str, causal: bool) -> None:
    torch.manual_seed(0)
    shape = (2, 4, 8, 16)  # (batch, heads, seq, head_dim)
    qkv = [torch.randn(shape, requires_grad=True) for _ in range(3)]
    ref_qkv = [t.detach().clone().requires_grad_() for t in qkv]
    op = FlashAttentionOp(name, apply_causal_mask=causal)
    out, ref = op(*qkv), _eager_attention(*ref_qkv, causal)
    torch.testing.assert_close(out, ref)
    grad = torch.randn(shape)
    out.backward(grad)
    ref.backward(grad)
    for t, r in zip(qkv, ref_qkv, strict=True):
        torch.testing.assert_close(t.grad, r.grad)


def test_flash_attention_op_mask_dropout_and_names() -> None:
    torch.manual_seed(0)
    q = k = v = torch.randn(1, 2, 6, 8)
    mask = torch.zeros(1, 1, 6, 6)
    mask[..., -1] = float("-inf")  # the last key is padding
    op = FlashAttentionOp("native_flash")
    expected = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8) + mask, dim=-1) @ v
    torch.testing.assert_close(op(q, k, v, mask), expected)
    assert torch.equal(op.eval()(q, k, v, p=0.9), op(q, k, v))  # no dropout in eval mode
    assert slapo.op.FlashAttentionOp is FlashAttentionOp
    with pytest.raises(slapo.SlapoError, match="attn_op_name"):
        FlashAttentionOp("no_such_kernel")
