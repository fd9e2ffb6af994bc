"""Tracing by need keeps the hierarchy, the parameters, dropout and autograd as they were."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import slapo
from graph_models import MLP, Attention, assert_same
from hf_models import LAYERS, assert_same_step, make, twin
from slapo.tracing import LeafError, ModeDropout, TraceError

FAMILIES = ["gpt2", "llama", "bert", "opt"]


@pytest.mark.parametrize("family", FAMILIES)
def test_trace_every_block_keeps_loss_and_gradients_in_train_and_eval(family):
    # float32 tolerance (the default): the traced graph may lay out intermediates differently
    # (strides, functionalized views), which changes float sums by an ulp on some CPUs.
    ref = make(family)
    model = twin(ref)
    sch = slapo.create_schedule(model)
    params = {n: id(p) for n, p in model.named_parameters()}
    layers = LAYERS[family]
    for name in sch[layers].child:
        gm = sch[f"{layers}.{name}"].trace()
        assert isinstance(gm, fx.GraphModule)
        assert model.get_submodule(f"{layers}.{name}") is gm
    assert {n: id(p) for n, p in model.named_parameters()} == params
    assert model.state_dict().keys() == ref.state_dict().keys()
    assert_same_step(ref, model)  # train mode: the same dropout masks
    ref.eval()
    model.eval()
    assert_same_step(ref, model)  # eval mode: dropout switched off as before tracing


def test_children_of_a_traced_block_stay_schedulable():
    model = make("llama")
    sch = slapo.create_schedule(model)
    sch["model.layers.0"].trace()
    down = sch["model.layers.0.mlp.down_proj"]
    assert down.mod is model.model.layers[0].mlp.down_proj
    assert down.parent is sch["model.layers.0.mlp"]
    assert [r.name for r in sch["model.layers.0"].applied_primitives] == ["trace"]


def test_export_leaves_keep_the_original_module():
    ref = make("llama")
    model = twin(ref)
    sch = slapo.create_schedule(model)
    attn = model.model.layers[0].self_attn
    sch["model.layers.0"].trace(leaves=["self_attn"])
    assert sch["model.layers.0.self_attn"].mod is attn
    assert type(attn).__name__ == "LlamaAttention"
    assert_same_step(ref, model)


def test_flatten_inlines_submodules_and_keeps_state_dict_keys():
    ref = make("gpt2")
    model = twin(ref)
    sch = slapo.create_schedule(model)
    gm = sch["transformer.h.0"].trace(flatten=True)
    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    assert calls and all("_slapo_" in t for t in calls)  # only the mode-following dropouts
    assert model.state_dict().keys() == ref.state_dict().keys()
    assert_same_step(ref, model)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_seed_examples_trace_with_both_tracers(tracer):
    x = torch.randn(2, 5, 16)
    for cls in (MLP, Attention):
        torch.manual_seed(0)
        ref = cls()
        model = cls()
        model.load_state_dict(ref.state_dict())
        sch = slapo.create_schedule(model)
        sch.trace(tracer=tracer, example_inputs=x if tracer == "export" else None)
        assert any(isinstance(m, ModeDropout) for m in sch.mod.modules()) or cls is MLP
        assert_same(ref, sch.mod, x)
        ref.eval()
        sch.mod.eval()
        assert_same(ref, sch.mod, x)


def test_example_inputs_from_the_schedule_are_used():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    sch = slapo.create_schedule(model, example_inputs=torch.randn(3, 4))
    gm = sch["1"].trace()
    assert isinstance(gm, fx.GraphModule)
    x = torch.randn(7, 4)  # another batch size: shapes are not specialized
    assert torch.equal(model(x), model[1](model[0](x)))


class Branchy(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x  # data-dependent control flow


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Branchy()

    def forward(self, x):
        return self.inner(x) + 1


def test_fx_failure_names_the_module_and_suggests_a_fix():
    sch = slapo.create_schedule(Outer())
    with pytest.raises(TraceError, match=r'"inner" \(Branchy\).*export'):
        sch["inner"].trace(tracer="fx")


def test_export_failure_names_the_innermost_module_and_suggests_leaves():
    sch = slapo.create_schedule(Outer())
    with pytest.raises(TraceError, match=r'"inner".*leaves=\["inner"\]'):
        sch.trace(example_inputs=torch.randn(3))
    sch.trace(tracer="fx", leaves=["inner"])  # the suggested fix works
    assert sch["inner"].mod.__class__ is Branchy


def test_export_without_inputs_and_trace_after_checkpoint_are_clear_errors():
    sch = slapo.create_schedule(MLP())
    with pytest.raises(TraceError, match="example inputs"):
        sch.trace(tracer="export")  # without a tracer named, fx traces it with no inputs
    sch.checkpoint()
    with pytest.raises(TraceError, match="checkpoint"):
        sch.trace(tracer="fx")


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_an_unknown_leaf_is_a_typed_error_listing_close_and_valid_names(tracer):
    model = make("llama")
    sch = slapo.create_schedule(model)
    layer = sch["model.layers.0"]
    with pytest.raises(LeafError, match=r'"model.layers.0" \(LlamaDecoderLayer\)') as info:
        layer.trace(tracer=tracer, leaves=["self_atn"])
    msg = str(info.value)
    assert "'self_atn' names no submodule" in msg and "Did you mean 'self_attn'" in msg
    assert "Module paths: self_attn, self_attn.q_proj" in msg and "LlamaAttention" in msg
    assert isinstance(info.value, slapo.SlapoError) and isinstance(info.value, ValueError)
    with pytest.raises(LeafError, match=r"'nonexistent' names no submodule"):
        layer.trace(tracer=tracer, leaves=["nonexistent"])
    with pytest.raises(LeafError, match=r"'proj\[' names no .*not a valid regex"):
        layer.trace(tracer=tracer, leaves=[r"proj["])
    with pytest.raises(LeafError, match="got a LlamaAttention object; give its path"):
        layer.trace(tracer=tracer, leaves=[model.model.layers[0].self_attn])
    assert not isinstance(layer.mod, fx.GraphModule)  # nothing was traced
    if tracer == "fx":  # fx cannot trace a transformers 5 layer (its forward takes **kwargs)
        outer = slapo.create_schedule(nn.Sequential(nn.Sequential(MLP()), MLP()))
        outer.trace(tracer="fx", leaves=["0.0", "MLP"])
        assert type(outer["0.0"].mod) is MLP and type(outer["1"].mod) is MLP
        return
    # Paths, suffixes one level down, class names, regexes and classes are all accepted.
    layer.trace(
        tracer=tracer, leaves=["mlp", "q_proj", "LlamaRMSNorm", r"self_attn\.o_.*", nn.ReLU]
    )
    assert isinstance(layer.mod, fx.GraphModule)
    assert type(sch["model.layers.0.mlp"].mod).__name__ == "LlamaMLP"
