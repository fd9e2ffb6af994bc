"""Subgraph replace (one chain, or parallel chains as in QKV) and subgraph checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slapo
from graph_models import Attention, FusedQKV, step
from hf_models import assert_same_step, make, twin


def qkv_grads(grads: dict, prefix: str = "") -> torch.Tensor:
    return torch.cat([grads[f"{prefix}{p}_proj.weight"] for p in "qkv"])


def test_horizontal_qkv_fusion_on_the_seed_attention():
    torch.manual_seed(0)
    ref = Attention()
    model = Attention()
    model.load_state_dict(ref.state_dict())
    sch = slapo.create_schedule(model)
    sch.trace(tracer="fx")
    qkv = sch.find(r"[qkv]_proj")
    assert len(qkv) == 3
    fused = FusedQKV(model.q_proj, model.k_proj, model.v_proj)
    sch.replace(fused, qkv, name="qkv")
    assert "q_proj" not in dict(sch.mod.named_children()) and "qkv_0" in sch.child
    x = torch.randn(2, 5, 16)
    loss_ref, g_ref = step(ref, x)
    loss, g = step(sch.mod, x)
    # One matmul instead of three: other BLAS blocking, so float32 tolerance, not bit-identity.
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(g["qkv_0.weight"], qkv_grads(g_ref))
    torch.testing.assert_close(g["qkv_0.bias"], torch.cat([g_ref[f"{p}_proj.bias"] for p in "qkv"]))
    for name in ("out_proj.weight", "out_proj.bias"):
        torch.testing.assert_close(g[name], g_ref[name])
    assert len(g) == 4 and len(g_ref) == 8  # every gradient was compared


def test_horizontal_qkv_fusion_in_a_traced_llama_attention():
    ref = make("llama")
    model = twin(ref)
    sch = slapo.create_schedule(model)
    attn = sch["model.layers.0.self_attn"]
    attn.trace()
    qkv = attn.find(r"[qkv]_proj")
    assert [s.output.target for s in qkv] == ["q_proj", "k_proj", "v_proj"]
    mod = ref.model.layers[0].self_attn  # the traced q/k/v are GraphModules: take the weights here
    attn.replace(FusedQKV(mod.q_proj, mod.k_proj, mod.v_proj), qkv, name="qkv_proj")
    data = {"input_ids": torch.randint(1, 96, (2, 12))}
    data["labels"] = data["input_ids"]
    from hf_models import run

    loss_ref, g_ref = run(ref, data)
    loss, g = run(model, data)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    fused = g["model.layers.0.self_attn.qkv_proj_0.weight"]
    torch.testing.assert_close(
        fused, qkv_grads(g_ref, "model.layers.0.self_attn."), atol=1e-6, rtol=1e-5
    )


def gelu_new_of_sum(x, b):
    y = x + b  # GPT-2's "gelu_new" (tanh approximation) of a biased input
    return (
        0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))
    )


class BiasGeluNew(nn.Module):
    def forward(self, x, b):
        return gelu_new_of_sum(x, b)


class BiasReLU(nn.Module):
    def forward(self, x, b):
        return F.relu(x + b)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_replace_one_chain_in_a_real_block(family):
    ref = make(family)
    model = twin(ref)
    sch = slapo.create_schedule(model)
    if family == "gpt2":
        path, linear, pattern, new = "transformer.h.0.mlp", "c_fc", gelu_new_of_sum, BiasGeluNew()
    else:
        path, linear, new = "model.decoder.layers.0", "fc1", BiasReLU()
        pattern = lambda x, b: F.relu(x + b)  # noqa: E731
    sch[f"{path}.{linear}"].decompose()
    sch[path].trace(flatten=True)
    found = sch[path].find(pattern)
    assert len(found) == 1
    sch[path].replace(new, found, name="bias_act")
    assert "bias_act_0" in sch[path].child
    # The decomposed linear (matmul, then add) rounds differently from addmm's fused bias.
    assert_same_step(ref, model, exact=False)


def test_checkpoint_a_subgraph_is_bit_identical_with_dropout():
    ref = make("gpt2")
    model = twin(ref)
    sch = slapo.create_schedule(model)
    attn = sch["transformer.h.0.attn"]
    attn.trace(flatten=True)
    # Attention with dropout inside (dropout_p follows the mode): recomputed in backward.
    found = attn.find(lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    assert len(found) == 1
    names = attn.checkpoint(found)
    assert names == ["checkpoint"]
    assert model.state_dict().keys() == ref.state_dict().keys()
    # Exact on any CPU and thread count: the traced block calls the same functions on the same
    # operands, and the non-reentrant checkpoint keeps the autograd graph (the same summation
    # order) while its recompute reruns the same kernels under the restored RNG state.
    assert_same_step(ref, model, exact=True)


def test_checkpoint_a_pattern_subgraph_of_the_seed_attention():
    torch.manual_seed(0)
    ref = Attention()
    model = Attention()
    model.load_state_dict(ref.state_dict())
    sch = slapo.create_schedule(model)
    sch.trace(tracer="fx")
    found = sch.find(lambda x: torch.softmax(x, dim=-1))
    assert len(found) == 1
    sch.checkpoint(found)
    x = torch.randn(2, 5, 16)
    loss_ref, g_ref = step(ref, x)
    loss, g = step(sch.mod, x)
    # Exact: the same calls, the same graph; the recompute reruns the same kernels (as above).
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)
    for name, grad in g_ref.items():
        torch.testing.assert_close(g[name], grad, rtol=0, atol=0)
