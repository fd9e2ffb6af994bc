"""Patterns as published Slapo code writes them: a residual pattern whose input is used twice, a
regex ``ModulePattern`` inside a ``slapo.Pattern`` (matched as ``re.match`` does), the attention
tutorial's ``ln_pattern`` over a decomposed and flattened ``Projection``, and
``trace(tracer="dynamo", concrete_args=...)`` of a BERT self-attention found by dynamo's module
names (``self_query``). Each check names the matched nodes exactly; where a model is then
changed, it still computes what the unscheduled one does (loss and every gradient)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import slapo
from slapo.pattern import call_module
from slapo.tracing import TraceError


def schedule_copy(ref: nn.Module, **kwargs) -> slapo.Schedule:
    """A schedule of a copy of ``ref``; its parameters remember their names in ``ref`` (``fuse``
    moves modules into the fused one, so names change; the parameter objects stay)."""
    sch = slapo.create_schedule(copy.deepcopy(ref), **kwargs)
    for name, param in sch.mod.named_parameters():
        param._test_name = name  # type: ignore[attr-defined]
    return sch


def _step(model: nn.Module, inputs: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks in both models
    out = model(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.pow(2).sum().backward()
    grads = {getattr(p, "_test_name", n): p.grad for n, p in model.named_parameters()}
    return out.detach(), {n: g for n, g in grads.items() if g is not None}


def assert_same_step(ref: nn.Module, test: nn.Module, *inputs: torch.Tensor) -> None:
    """Same output and every gradient, by the parameter's name in ``ref``."""
    out_ref, g_ref = _step(ref, inputs)
    out, g = _step(test, inputs)
    torch.testing.assert_close(out, out_ref)
    assert set(g) == set(g_ref), set(g) ^ set(g_ref)
    for name, grad in g_ref.items():
        torch.testing.assert_close(g[name], grad, msg=lambda m, n=name: f"{n}: {m}")


# ----- 1. a pattern whose input is used twice (a residual) ------------------------------------
def residual(x):
    return F.relu(x) + x


class Residuals(nn.Module):
    """Two residual blocks, a look-alike (relu of one value added to another) and the module
    form of relu in the second block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x):
        h = self.fc1(x)
        h = F.relu(h) + h  # a residual
        g = self.fc2(h)
        g = self.act(g) + g  # a residual, relu as a module
        return F.relu(g) + h  # relu of g added to h: not a residual


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_residual_pattern_matches_a_value_used_twice(tracer: str) -> None:
    torch.manual_seed(0)
    ref = Residuals()
    sch = schedule_copy(ref)
    x = torch.randn(3, 8)
    sch.trace(tracer=tracer, example_inputs=x if tracer == "export" else None)
    found = sch.find(residual)
    # torch.export rebuilds nn.ReLU as a GraphModule "act": still relu.
    assert [[n.name for n in s.nodes] for s in found] == [["relu", "add"], ["act", "add_1"]]
    assert [s.nodes[0].op for s in found] == ["call_function", "call_module"]
    assert [s.inputs[0].name for s in found] == ["fc1", "fc2"]  # x: the one value used twice
    for s in found:  # relu's input and the add's other operand are that one value
        relu, add = s.nodes
        assert relu.args[0] is s.inputs[0] and set(add.args) == {relu, s.inputs[0]}
    sch.fuse(found, compiler=None, name="Residual")
    assert {"Residual_0", "Residual_1"} <= set(sch.child)
    assert_same_step(ref, sch.mod, x)


# ----- 2. a regex ModulePattern inside a Pattern -----------------------------------------------
class LeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def linear_relu(regex: str) -> slapo.Pattern:
    class LinearReLU(slapo.Pattern):
        def __init__(self) -> None:
            super().__init__()
            self.fc = slapo.ModulePattern(regex)

        def forward(self, x):
            return F.relu(self.fc(x))

    return LinearReLU()


def test_a_regex_module_pattern_matches_every_module_it_names() -> None:
    torch.manual_seed(0)
    ref = LeNet()
    sch = schedule_copy(ref)
    found = sch.find(linear_relu(r"fc?"))  # Slapo's regex: re.match, "fc?" matches "fc1"
    assert [[(n.op, n.target) for n in s.nodes] for s in found] == [
        [("call_module", "fc1"), ("call_function", F.relu)],
        [("call_module", "fc2"), ("call_function", F.relu)],
    ]
    assert [[n.name for n in s.nodes] for s in found] == [["fc1", "relu_2"], ["fc2", "relu_3"]]
    sch.fuse(found, compiler=None, name="LinearReLU")
    assert_same_step(ref, sch.mod, torch.randn(2, 1, 28, 28))


def test_name_regexes_match_from_the_start_of_the_name() -> None:
    sch = slapo.create_schedule(LeNet())

    def targets(pattern) -> list[list[str]]:
        return [
            [str(n.target) for n in s.nodes if n.op == "call_module"] for s in sch.find(pattern)
        ]

    assert targets(linear_relu(r"fc1$")) == [["fc1"]]  # "$": the whole name
    assert targets(linear_relu(r"conv")) == [["conv1"], ["conv2"]]
    assert targets(linear_relu(r"1")) == []  # not a search: "fc1" does not start with "1"
    assert targets(linear_relu(r"Linear")) == [["fc1"], ["fc2"]]  # the class name: whole
    assert targets(linear_relu(r"Lin")) == []
    assert targets(r"fc") == [["fc1"], ["fc2"], ["fc3"]]  # find(regex) alike
    assert targets(lambda x: F.relu(call_module(r"fc?", x))) == [["fc1"], ["fc2"]]


# ----- 3. the attention tutorial's Projection: decompose, flatten, ln_pattern ------------------
class Projection(nn.Module):  # as in the attention tutorial
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.dropout = nn.Dropout(0.1)
        self.layer_norm = nn.LayerNorm(hidden_size)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.layer_norm(hidden_states + input_tensor)
        return hidden_states


def ln_pattern(x, bias, residual):  # as in the attention tutorial
    return F.layer_norm(F.dropout(x + bias) + residual, 1024)


def test_the_tutorials_layer_norm_pattern_on_a_decomposed_flattened_projection() -> None:
    torch.manual_seed(0)
    ref = Projection(1024)
    sch = schedule_copy(ref)
    sch["dense"].decompose()
    sch.trace(flatten=True)
    found = sch.find(ln_pattern)
    assert len(found) == 1
    match = found[0]
    assert [(n.op, n.name) for n in match.nodes] == [
        ("call_function", "add"),  # the bias add of the decomposed linear
        ("call_module", "dropout"),  # nn.Dropout for F.dropout
        ("call_function", "add_1"),  # the residual
        ("call_module", "layer_norm"),  # nn.LayerNorm for F.layer_norm
    ]
    assert [str(n.target) for n in match.nodes if n.op == "call_module"] == [
        "dropout",
        "layer_norm",
    ]
    x, bias, residual = match.inputs
    assert bias.op == "get_attr" and bias.target == "dense.bias"
    assert x.name == "linear" and (residual.op, residual.target) == ("placeholder", "input_tensor")
    # The module's normalized shape must agree with the pattern's: 512 is another layer norm.
    assert sch.find(lambda x, b, r: F.layer_norm(F.dropout(x + b) + r, 512)) == []
    sch.fuse(found, compiler="TorchScript", name="FusedLayerNorm")
    assert "FusedLayerNorm_0" in sch.child
    inputs = torch.randn(2, 3, 1024), torch.randn(2, 3, 1024)
    assert_same_step(ref, sch.mod, *inputs)  # training mode: dropout masks drawn alike
    assert_same_step(ref.eval(), sch.mod.eval(), *inputs)


class LinearDropout(nn.Module):
    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.2)
        self.functional = functional

    def forward(self, x):
        h = self.fc(x)
        h = F.dropout(h, 0.2, self.training) if self.functional else self.drop(h)
        return torch.tanh(h)


@pytest.mark.parametrize("functional", [False, True], ids=["nn.Dropout", "F.dropout"])
def test_bias_add_and_dropout_on_a_decomposed_linear(functional: bool) -> None:
    torch.manual_seed(0)
    ref = LinearDropout(functional)
    sch = schedule_copy(ref)
    sch["fc"].decompose()
    sch.trace()  # the decomposed layer is inlined: its bias add is a node of this graph
    found = sch.find(lambda x, bias: F.dropout(x + bias))
    assert len(found) == 1
    add, drop = found[0].nodes
    assert add.op == "call_function" and add.name == "add"
    # F.dropout in the graph becomes a mode-aware dropout module; nn.Dropout stays one.
    assert drop.op == "call_module" and drop.target == (
        "_slapo_dropout_0" if functional else "drop"
    )
    assert found[0].inputs[1].target == "fc.bias"
    sch.fuse(found, compiler=None, name="BiasDropout")
    assert_same_step(ref, sch.mod, torch.randn(4, 16))
    assert_same_step(ref.eval(), sch.mod.eval(), torch.randn(4, 16))


# ----- 4. tracer="dynamo" with concrete_args on a BERT self-attention ---------------------------
def _bert_config():
    transformers = pytest.importorskip("transformers")
    return transformers.BertConfig(
        hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=1,
        vocab_size=64, max_position_embeddings=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip


def _concrete_args(mod: nn.Module, input_names: list[str]) -> dict:
    """Slapo's published spelling: every other argument fixed to its signature's default."""
    sig = inspect.signature(mod.forward)
    return {p.name: p.default for p in sig.parameters.values() if p.name not in input_names}


def qkv_pattern(x):
    return call_module(r"self_(query|key|value)", x)


def test_dynamo_trace_with_concrete_args_finds_the_projections_by_dynamos_names() -> None:
    transformers = pytest.importorskip("transformers")
    with slapo.init_empty_weights():  # Slapo's own: no memory for the weights
        model = transformers.BertModel(_bert_config())
    sch = slapo.create_schedule(model)
    sub = sch["encoder.layer.0.attention.self"]
    assert sub.mod.query.weight.is_meta
    gm = sub.trace(tracer="dynamo", concrete_args=_concrete_args(sub.mod, ["hidden_states"]))
    assert isinstance(gm, fx.GraphModule)
    found = sub.find(qkv_pattern)
    assert [[(n.op, n.target) for n in s.nodes] for s in found] == [
        [("call_module", "query")],
        [("call_module", "key")],
        [("call_module", "value")],
    ]
    assert [s.path for s in found] == ["", "", ""]
    assert [s.inputs[0] for s in found] == [found[0].inputs[0]] * 3  # one hidden-states input
    # The modules keep their own paths: schedules, parameters and checkpoints are unchanged.
    assert sub["query"].mod is gm.get_submodule("query")
    assert [s[0][1].target for s in sub.find(r"self_(query|key|value)")] == [
        "query",
        "key",
        "value",
    ]


def test_dynamos_names_are_only_known_in_a_graph_traced_with_dynamo() -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.BertModel(_bert_config())
    sch = slapo.create_schedule(model)
    sub = sch["encoder.layer.0.attention.self"]
    sub.trace(tracer="huggingface")
    assert sub.find(qkv_pattern) == []
    assert [s.output.target for s in sub.find(lambda x: call_module(r"query|key", x))] == [
        "query",
        "key",
    ]


def test_a_dynamo_traced_attention_computes_what_the_original_does() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = transformers.BertModel(_bert_config())
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 64, (2, 6))
    sch = slapo.create_schedule(model, example_inputs={"input_ids": ids})
    sub = sch["encoder.layer.0.attention.self"]
    sub.trace(tracer="dynamo", concrete_args=_concrete_args(sub.mod, ["hidden_states"]))
    assert len(sub.find(qkv_pattern)) == 3
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, -2:] = 0  # padding: a mask the graph was not traced with (traced again for it)
    for kwargs in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": mask}):
        outs, grads = [], []
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
            out = m(**kwargs).last_hidden_state
            out.pow(2).sum().backward()
            outs.append(out.detach())
            grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
        torch.testing.assert_close(outs[1], outs[0])
        assert set(grads[1]) == set(grads[0])
        for name, grad in grads[0].items():
            torch.testing.assert_close(grads[1][name], grad, msg=lambda m, n=name: f"{n}: {m}")


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, scale=None):
        h = self.fc(x)
        return h if scale is None else h * scale


def test_concrete_args_fix_the_arguments_torch_export_traces() -> None:
    torch.manual_seed(0)
    ref = Scaled()
    x = torch.randn(3, 8)
    sch = schedule_copy(ref)
    gm = sch.trace(
        tracer="dynamo", example_inputs=(x, torch.tensor(2.0)), concrete_args={"scale": None}
    )
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert not any("mul" in op for op in ops), ops  # traced with scale=None, as fixed
    assert_same_step(ref, gm, x)
    torch.testing.assert_close(gm(x, torch.tensor(3.0)), ref(x, torch.tensor(3.0)))  # again
    with pytest.raises(TraceError, match=r"concrete_args names 'bias'.*no named argument"):
        slapo.create_schedule(Scaled()).trace(
            tracer="dynamo", example_inputs=(x,), concrete_args={"bias": None}
        )
