"""slapo.op modules equal their plain-PyTorch definitions; decompose keeps numerics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import slapo
from hf_models import assert_same_step, make, twin
from slapo import op
from slapo.primitives.decompose import DecomposedLinear


def test_decompose_linear_and_conv1d():
    lin = nn.Linear(8, 6)
    conv = transformers.pytorch_utils.Conv1D(6, 8)
    x = torch.randn(3, 4, 8)
    for mod in (lin, conv):
        model = nn.Sequential(mod)
        want = model(x)
        sch = slapo.create_schedule(model)
        sch["0"].decompose()
        assert isinstance(model[0], DecomposedLinear) and model[0].weight is mod.weight
        torch.testing.assert_close(model(x), want)
    with pytest.raises(slapo.PrimitiveError, match="only nn.Linear"):
        slapo.create_schedule(nn.Sequential(nn.ReLU()))["0"].decompose()


def test_decompose_in_gpt2_keeps_loss_and_grads():
    ref = make("gpt2")
    model = twin(ref)
    sch = slapo.create_schedule(model)
    sch["transformer.h.0.mlp.c_fc"].decompose()
    sch["transformer.h.0.attn.c_attn"].decompose()
    assert model.state_dict().keys() == ref.state_dict().keys()
    # matmul then add rounds differently from addmm's fused bias (BLAS- and CPU-dependent).
    assert_same_step(ref, model, exact=False)


@pytest.mark.parametrize("impl", ["eager", "sdpa", "auto"])
def test_attention_impls_equal_the_reference(impl):
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    k2, v2 = k[:, :2], v[:, :2]  # grouped-query: 2 K/V heads for 4 query heads
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(op.attention(q, k, v, is_causal=True, impl=impl), want)
    rep = lambda t: t.repeat_interleave(2, dim=1)  # noqa: E731
    want_gqa = F.scaled_dot_product_attention(q, rep(k2), rep(v2))
    torch.testing.assert_close(op.attention(q, k2, v2, impl=impl), want_gqa)
    with pytest.raises(slapo.SlapoError, match="flash"):
        op.attention(q, k, v, impl="flash")  # CPU: a clear error, no silent fall-back


def test_transformers_attention_registration_matches_sdpa():
    ref = make("llama", dropout=0.0)
    model = twin(ref)
    name = op.register_transformers_attention()
    model.set_attn_implementation(name)
    assert_same_step(ref, model, exact=False)  # another attention kernel: another summation order


@pytest.mark.parametrize("bias", [True, False])
def test_linear_cross_entropy_equals_the_plain_head(bias):
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=bias)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :3] = -100
    want = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), ignore_index=-100)
    want.backward()
    grads = [hidden.grad.clone(), head.weight.grad.clone()]
    hidden.grad = None
    head.zero_grad()
    loss = op.LinearCrossEntropy(head, chunk_size=4)(hidden, labels)
    loss.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(hidden.grad, grads[0])
    torch.testing.assert_close(head.weight.grad, grads[1])


def test_bias_modules_and_print():
    x, b, r = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    act = op.FusedBiasGELU(bias=nn.Parameter(b.clone()), compiler=None)
    torch.testing.assert_close(act(x), F.gelu(x + b))
    block = op.BiasDropoutResidual(p=0.5, compiler=None)
    torch.manual_seed(0)
    got = block(x, b, r)
    torch.manual_seed(0)
    torch.testing.assert_close(got, r + F.dropout(x + b, 0.5))
    block.eval()
    torch.testing.assert_close(block(x, b, r), r + x + b)
    assert op.Print("here", stats=True)(x) is x
