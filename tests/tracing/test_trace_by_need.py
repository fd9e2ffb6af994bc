"""Trace by need: static-graph primitives trace the module they are called on, with no explicit
``trace()`` and no example inputs where none are needed; the seed's spellings of ``trace`` and
``fuse``; partial checkpoint keeps parameter names. Each case is checked against the unscheduled
model (loss and gradients)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import slapo
from graph_models import MLP, Attention, FusedQKV, assert_same, step
from hf_models import assert_same_step, make, run, twin
from slapo.pattern import call_module
from slapo.tracing import TraceError


class Block(nn.Module):
    """The seed's attention and MLP in one pre-norm block."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.attn = Attention(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


def twins(cls: type[nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = cls()
    return ref, copy.deepcopy(ref)


@pytest.fixture
def trace_log() -> Iterator[list[str]]:
    """The messages slapo logs (its logger does not propagate to the root logger)."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = slapo.logger.get_logger()
    handler = Keep(level=logging.INFO)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def traces(log: list[str]) -> list[str]:
    return [m for m in log if m.startswith("traced ")]


X = torch.randn(2, 5, 16)


def test_find_traces_only_the_module_asked_for(trace_log):
    ref, model = twins(Block)
    sch = slapo.create_schedule(model)
    found = sch["attn"].find(r"[qkv]_proj")  # no trace() before
    assert [s.output.target for s in found] == ["q_proj", "k_proj", "v_proj"]
    assert isinstance(sch["attn"].mod, fx.GraphModule)
    # The smallest module asked for: the rest stays eager.
    assert not isinstance(sch.mod, fx.GraphModule)
    assert not isinstance(sch["mlp"].mod, fx.GraphModule)
    (line,) = traces(trace_log)
    assert line.startswith('traced "attn" (Attention) with torch.fx in ')
    # Found again: traced once only.
    assert len(sch["attn"].find(lambda x: torch.softmax(x, dim=-1))) == 1
    assert len(traces(trace_log)) == 1
    assert_same(ref, model, X)


def test_trace_without_inputs_uses_fx(trace_log):
    ref, model = twins(MLP)
    sch = slapo.create_schedule(model)
    gm = sch.trace()  # a plain module, no example inputs: fx needs none
    assert isinstance(gm, fx.GraphModule)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == [
        "linear1",
        "linear2",
        "dropout",
    ]
    assert traces(trace_log)[0].startswith('traced "<root>" (MLP) with torch.fx')
    assert_same(ref, sch.mod, X, exact=True)  # the same module calls in the same order


@pytest.mark.parametrize(
    ("tracer", "used"),
    [
        ("pytorch", "torch.fx"),
        ("huggingface", "torch.fx"),
        ("fx", "torch.fx"),
        ("dynamo", "torch.export"),
        ("auto", "torch.fx"),
    ],
)
def test_slapo_tracer_names(tracer, used, trace_log):
    ref, model = twins(MLP)
    sch = slapo.create_schedule(model, example_inputs=X)
    sch.trace(tracer=tracer)
    assert f"with {used} " in traces(trace_log)[0]
    assert_same(ref, sch.mod, X)  # export records aten ops (other kernels): float32 tolerance


def test_unknown_tracer_lists_the_names():
    sch = slapo.create_schedule(MLP())
    with pytest.raises(TraceError, match=r"unknown tracer 'torchscript'.*'pytorch'.*'dynamo'"):
        sch.trace(tracer="torchscript")
    assert not isinstance(sch.mod, fx.GraphModule)


def test_trace_leaves_and_flatten_positionally():
    ref, model = twins(Block)
    sch = slapo.create_schedule(model)
    gm = sch.trace(["attn"], True)  # the seed's s.trace(leaves, flatten)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert "attn" in calls and "mlp" not in calls and "mlp.linear1" in calls
    assert type(sch["attn"].mod) is Attention
    sch2 = slapo.create_schedule(copy.deepcopy(ref))
    sch2.trace(leaves=["attn"], flatten=True)
    assert str(sch2.mod.graph) == str(gm.graph)
    assert_same(ref, sch.mod, X, exact=True)  # the same calls, only inlined


def test_a_transformers_block_is_exported_on_captured_inputs(trace_log):
    ref = make("llama")
    model = twin(ref)
    sch = slapo.create_schedule(model)
    layer = sch["model.layers.0"]
    qkv = layer.find(r"[qkv]_proj")  # fx cannot trace the layer (**kwargs): export by need
    assert [s.path for s in qkv] == ["self_attn"] * 3
    (line,) = traces(trace_log)
    assert line.startswith('traced "model.layers.0" (LlamaDecoderLayer) with torch.export')
    assert "fx could not" in line
    assert not isinstance(sch["model.layers.1"].mod, fx.GraphModule)
    mod = ref.model.layers[0].self_attn
    layer.replace(FusedQKV(mod.q_proj, mod.k_proj, mod.v_proj), qkv, name="qkv_proj")
    data = {"input_ids": torch.randint(1, 96, (2, 12))}
    data["labels"] = data["input_ids"]
    loss_ref, g_ref = run(ref, data)
    loss, g = run(model, data)
    # One matmul for q, k, v: another BLAS blocking, float32 tolerance.
    torch.testing.assert_close(loss, loss_ref)
    fused = torch.cat([g_ref[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(g["model.layers.0.self_attn.qkv_proj_0.weight"], fused)
    for name, grad in g_ref.items():
        if "layers.0.self_attn." not in name or "o_proj" in name:
            torch.testing.assert_close(g[name], grad, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("order", ["compiler_first", "subgraph_first"])
def test_decompose_find_fuse_in_either_order(order):
    ref, model = twins(MLP)
    sch = slapo.create_schedule(model)
    sch["linear1"].decompose()
    found = sch.find(lambda x, bias: F.gelu(bias + x))  # no trace(): the decomposed add is seen
    assert len(found) == 1
    if order == "compiler_first":
        names = sch.fuse(None, found, "BiasGeLU")  # the seed's s.fuse(compiler, subgraph)
    else:
        names = sch.fuse(found, compiler=None, name="BiasGeLU")
    assert names == ["BiasGeLU_0"]
    assert sorted(sch.mod.state_dict()) == sorted(ref.state_dict())
    assert_same(ref, sch.mod, X)  # matmul then add vs addmm: float32 tolerance


def test_fuse_torchscript_first_as_in_the_seed():
    ref, model = twins(MLP)
    sch = slapo.create_schedule(model)
    sch["linear1"].decompose()
    names = sch.fuse("TorchScript", sch.find(lambda x, bias: F.gelu(bias + x)))
    assert names == ["FusedModule_0"]
    assert isinstance(sch["FusedModule_0"].mod, torch.jit.ScriptModule)
    assert_same(ref, sch.mod, X)  # scripted kernels: float32 tolerance


def test_fuse_arguments_are_checked():
    sch = slapo.create_schedule(MLP())
    found = sch.find(lambda x: F.gelu(x))
    with pytest.raises(slapo.PrimitiveError, match="needs the subgraph"):
        sch.fuse("TorchScript")
    with pytest.raises(slapo.PrimitiveError, match="compiler is given twice"):
        sch.fuse(None, found, compiler="inductor")
    with pytest.raises(slapo.PrimitiveError, match="int is neither a subgraph"):
        sch.fuse(3, found)


def test_partial_replace_on_an_untraced_module():
    ref, model = twins(Attention)
    sch = slapo.create_schedule(model)
    fused = FusedQKV(model.q_proj, model.k_proj, model.v_proj)
    sch.replace(fused, sch.find(r"[qkv]_proj"), name="qkv")  # find traces by need
    loss_ref, g_ref = step(ref, X)
    loss, g = step(sch.mod, X)
    # One matmul instead of three: another BLAS blocking, float32 tolerance.
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(
        g["qkv_0.weight"], torch.cat([g_ref[f"{p}_proj.weight"] for p in "qkv"])
    )
    torch.testing.assert_close(g["qkv_0.bias"], torch.cat([g_ref[f"{p}_proj.bias"] for p in "qkv"]))
    for name in ("out_proj.weight", "out_proj.bias"):
        torch.testing.assert_close(g[name], g_ref[name])


def test_partial_checkpoint_keeps_parameter_names_and_loads_old_state_dicts():
    ref = make("llama")
    saved = copy.deepcopy(ref.state_dict())  # saved before scheduling
    model = twin(ref)
    sch = slapo.create_schedule(model)
    mlp = sch["model.layers.0.mlp"]

    def pattern(x):  # LlamaMLP's gated half: act(gate(x)) * up(x)
        return call_module("act_fn", call_module("gate_proj", x)) * call_module("up_proj", x)

    assert mlp.checkpoint(mlp.find(pattern)) == ["checkpoint"]
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    model.load_state_dict(saved, strict=True)
    # Exact: the traced MLP calls the same modules on the same operands; the non-reentrant
    # checkpoint keeps the autograd graph and recomputes with the same kernels.
    assert_same_step(ref, model, exact=True)
    ref.eval()
    model.eval()
    assert_same_step(ref, model, exact=True)


def test_partial_checkpoint_survives_deepcopy_and_train_eval():
    ref, model = twins(MLP)
    sch = slapo.create_schedule(model)
    sch.checkpoint(sch.find(lambda x: F.gelu(call_module("linear1", x))))
    assert sorted(sch.mod.state_dict()) == sorted(ref.state_dict())
    copied = copy.deepcopy(sch.mod)
    assert copied.checkpoint.graph_module.linear1 is copied.linear1  # shared, not duplicated
    assert_same(ref, copied, X, exact=True)  # same calls, recomputed with the same kernels
    ref.eval()
    sch.mod.eval()
    assert_same(ref, sch.mod, X, exact=True)


def test_cut_pipeline_stage_inside_a_block():
    from slapo.pipeline import partition_model
    from slapo.primitives.cut_pipeline_stage import pipeline_cuts

    ref = make("gpt2", dropout=0.0)  # no dropout: the stages need not replay the RNG order
    model = twin(ref)
    sch = slapo.create_schedule(model)
    sch["transformer.h.0.attn"].cut_pipeline_stage()  # inside block 0, no trace() before
    sch["transformer.h.1.mlp"].cut_pipeline_stage()
    data = {"input_ids": torch.randint(1, 96, (2, 12))}
    part = partition_model(model, pipeline_cuts(sch), (data["input_ids"],), {"use_cache": False})
    assert len(part.stages) == 3
    values: tuple = (data["input_ids"],)
    for stage in part.stages[:-1]:
        values = stage(*values)
    logits = part.stages[-1](*values)
    logits = logits[0] if isinstance(logits, tuple) else logits
    ref_logits = ref(**data, use_cache=False).logits
    # Exact: the stages run the model's own calls on the same operands, only cut into pieces.
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    ref_logits.pow(2).mean().backward()
    logits.pow(2).mean().backward()
    # The tied embedding / head weight is one copy per stage (the target sums their gradients).
    tied = {"lm_head.weight": "transformer.wte.weight"}
    grads: dict[str, torch.Tensor] = {}
    for stage in part.stages:
        for name, p in stage.named_parameters():
            name = tied.get(name, name)
            grads[name] = grads[name] + p.grad if name in grads else p.grad
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert set(grads) == set(ref_grads)
    for name, grad in ref_grads.items():
        # The backward of the exported graph: float32 tolerance.
        torch.testing.assert_close(grads[name], grad, msg=lambda m, n=name: f"{n}: {m}")


def test_both_tracers_failing_is_one_error_with_both_reasons():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x) * 2 if x.sum() > 0 else x  # data-dependent control flow

    model = nn.Sequential(Branchy())
    sch = slapo.create_schedule(model, example_inputs=torch.randn(2, 3))
    with pytest.raises(TraceError) as info:
        sch["0"].find(r"proj")
    lines = str(info.value).splitlines()
    assert lines[0] == 'cannot trace "0" (Branchy) with fx nor with torch.export:'
    assert lines[1].startswith("  fx: ") and "control flow" in lines[1]
    assert lines[2].startswith("  torch.export: ") and len(lines) == 3
    assert type(sch["0"].mod) is Branchy  # nothing changed


def test_no_inputs_anywhere_names_both_reasons():
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 if x.sum() > 0 else x

    sch = slapo.create_schedule(Branchy())
    with pytest.raises(TraceError, match=r"(?s)fx: .*torch.export: .*needs example inputs"):
        sch.trace()
