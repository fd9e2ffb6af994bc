"""Meta-device models materialized by build, and the memory saved by checkpointing."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import slapo
from hf_models import assert_same_step, llama, make


def test_init_empty_weights_puts_parameters_on_meta_and_keeps_buffers_real():
    with slapo.init_empty_weights():
        model = llama(dropout=0.0)
    assert all(p.is_meta for p in model.parameters())
    inv_freq = model.model.rotary_emb.inv_freq
    assert not inv_freq.is_meta
    with slapo.init_empty_weights(include_buffers=True):
        model = llama(dropout=0.0)
    assert model.model.rotary_emb.inv_freq.is_meta
    with slapo.init_empty_weights(enable=False):
        assert not nn.Linear(2, 2).weight.is_meta
    assert not nn.Linear(2, 2).weight.is_meta  # the patch is gone after the block


@pytest.mark.parametrize("include_buffers", [False, True])
def test_build_materializes_a_meta_llama_with_its_own_init(include_buffers):
    real = llama(dropout=0.0)
    with slapo.init_empty_weights(include_buffers=include_buffers):
        model = llama(dropout=0.0)
    sch = slapo.create_schedule(model)
    sch["model.layers.0.self_attn.q_proj"].annotate("weight", "tp_axis", 0)
    sch["model.layers.0"].checkpoint()
    built, _ = slapo.build(sch)
    assert not slapo.initialization.has_meta_tensors(built)
    rot = built.model.rotary_emb
    # Exact: build recomputes inv_freq with the model's own rope function, the constructor's ops.
    torch.testing.assert_close(rot.inv_freq, real.model.rotary_emb.inv_freq, rtol=0, atol=0)
    assert built.model.layers[0].self_attn.q_proj.weight.tp_axis == 0
    std = real.config.initializer_range
    w = built.model.layers[1].mlp.down_proj.weight
    assert abs(w.std().item() - std) < 0.25 * std  # HF's normal(0, initializer_range)
    norm = built.model.layers[1].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))  # exact: a constant fill
    # The materialized model trains: its loss is finite and its gradients flow.
    loss = built(
        **{
            "input_ids": torch.ones(1, 4, dtype=torch.long),
            "labels": torch.ones(1, 4, dtype=torch.long),
        }
    ).loss
    loss.backward()
    assert torch.isfinite(loss) and built.model.embed_tokens.weight.grad is not None


def test_build_keeps_tied_weights_tied():
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    with slapo.init_empty_weights():
        model = transformers.GPT2LMHeadModel(cfg)
    built, _ = slapo.build(slapo.create_schedule(model))
    assert built.lm_head.weight is built.transformer.wte.weight
    assert not built.lm_head.weight.is_meta


def test_build_with_a_callable_initializes_each_materialized_module_and_spares_real_ones():
    with slapo.init_empty_weights():
        meta_part = nn.Linear(3, 3)
    real_part = nn.Linear(3, 3)
    before = real_part.weight.detach().clone()
    model = nn.Sequential(meta_part, real_part)
    seen = []

    def init(module):
        seen.append(module)
        nn.init.constant_(module.weight, 0.5)
        nn.init.zeros_(module.bias)

    built, _ = slapo.build(slapo.create_schedule(model), init_weights=init)
    assert seen == [meta_part]
    assert torch.equal(built[0].weight, torch.full((3, 3), 0.5))  # exact: a constant fill
    assert torch.equal(built[1].weight, before)  # exact: left untouched


def test_plain_modules_use_reset_parameters_and_init_false_keeps_meta():
    with slapo.init_empty_weights():
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    kept, _ = slapo.build(slapo.create_schedule(model), init_weights=False)
    assert kept[0].weight.is_meta
    built, _ = slapo.build(slapo.create_schedule(model))
    assert torch.equal(built[1].weight, torch.ones(8))  # exact: LayerNorm's constant init
    assert built[0].weight.abs().max() <= 1 / 8**0.5 + 1e-6 and built[0].weight.std() > 0


def _saved_bytes(model, data):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**data).loss
    loss.backward()
    return total


def test_checkpointing_every_llama_layer_more_than_halves_saved_bytes():
    ref = make("llama", dropout=0.0, layers=4)
    data = {"input_ids": torch.randint(0, 96, (2, 32))}
    data["labels"] = data["input_ids"]
    plain = _saved_bytes(ref, data)
    model = make("llama", dropout=0.0, layers=4)
    sch = slapo.create_schedule(model)
    for i in range(4):
        sch[f"model.layers.{i}"].checkpoint()
    ckpt = _saved_bytes(model, data)
    assert ckpt < plain / 2, (ckpt, plain)
    # Exact on any CPU: the non-reentrant checkpoint keeps the graph and reruns the same kernels.
    assert_same_step(ref, model, exact=True)


def test_slapo_checkpoint_function_and_seed_helpers():
    assert slapo.set_random_seed(5, dp_rank=1, pp_rank=2) == 5 + 200 + 10
    assert slapo.is_random_seed_set()
    a = torch.rand(3)
    slapo.set_random_seed(5, dp_rank=0, pp_rank=2)
    assert not torch.equal(torch.rand(3), a)  # another data-parallel rank, another stream
    slapo.set_random_seed(5, dp_rank=1, pp_rank=2)
    assert torch.equal(torch.rand(3), a)  # exact: the same seed gives the same stream

    layer = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    x = torch.randn(3, 4, requires_grad=True)
    torch.manual_seed(0)
    y = slapo.checkpoint(layer, x)
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    torch.manual_seed(0)
    layer(x).sum().backward()
    # Exact: the same graph and kernels; the recompute draws the same dropout mask.
    torch.testing.assert_close(x.grad, g, rtol=0, atol=0)
    with pytest.raises(slapo.SlapoError, match="use_reentrant=False"):
        slapo.checkpoint(layer, x, use_reentrant=True, scale=2)


def _meta_mlp() -> nn.Module:
    with slapo.init_empty_weights():
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4), nn.LayerNorm(4))


def test_build_initializes_a_plain_module_that_torch_export_traced_on_meta():
    """torch.export rebuilds the Linears as GraphModules (no reset_parameters): build
    initializes them through the modules they were traced from, in the untraced order."""
    x = torch.randn(2, 8)
    sch = slapo.create_schedule(_meta_mlp(), example_inputs=[x.to("meta")])
    sch.trace(tracer="export")
    assert not isinstance(sch.mod.get_submodule("0"), nn.Linear)
    torch.manual_seed(5)
    built, _ = slapo.build(sch)
    reference = _meta_mlp()
    torch.manual_seed(5)
    slapo.initialization.materialize_module(reference)
    want = reference.state_dict()
    got = built.state_dict()
    assert got.keys() == want.keys()
    for name, value in got.items():
        assert torch.equal(value, want[name]), name
    torch.testing.assert_close(built(x), reference(x))
