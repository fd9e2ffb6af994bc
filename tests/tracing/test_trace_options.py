"""Slapo's trace options run unchanged: ``recursive``, ``leaf_modules``, ``concrete_args`` (also
with ``tracer="huggingface"``) and ``config``. Each traced module gives the original's output and
gradients, and the leaves stay ``call_module`` nodes of the original submodules."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

import slapo


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.inner = Inner()
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(self.inner(self.fc1(x)))


class Scaled(Outer):
    """A forward that branches on an argument: fx traces it with ``concrete_args`` only."""

    def forward(self, x, scale=None):
        h = self.inner(self.fc1(x))
        if scale is not None:
            h = h * scale
        return self.fc2(h)


def _modules_called(gm: fx.GraphModule) -> set[str]:
    return {n.target for n in gm.graph.nodes if n.op == "call_module"}


def _check_same(model: nn.Module, ref: nn.Module, *inputs) -> None:
    out, expected = model(*inputs), ref(*inputs)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)


def test_recursive_false_keeps_children_untraced() -> None:
    torch.manual_seed(0)
    model = Outer()
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    gm = sch.trace(recursive=False, flatten=True, tracer="pytorch")
    assert _modules_called(gm) == {"fc1", "inner", "fc2"}
    assert type(gm.get_submodule("inner")) is Inner  # not traced: the original child
    _check_same(gm, ref, torch.randn(3, 8))


def test_recursive_default_traces_children() -> None:
    sch = slapo.create_schedule(Outer())
    gm = sch.trace(tracer="pytorch")
    assert isinstance(gm.get_submodule("inner"), fx.GraphModule)


def test_leaf_modules_alias_of_leaves() -> None:
    torch.manual_seed(0)
    model = Outer()
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    gm = sch.trace(flatten=True, tracer="pytorch", leaf_modules=["Inner"])
    assert _modules_called(gm) == {"fc1", "inner", "fc2"}
    assert type(gm.get_submodule("inner")) is Inner
    _check_same(gm, ref, torch.randn(3, 8))


def test_leaf_modules_joined_with_leaves_and_checked() -> None:
    sch = slapo.create_schedule(Outer())
    gm = sch.trace(flatten=True, leaves=["fc1"], leaf_modules=["inner.fc"])
    assert _modules_called(gm) >= {"fc1", "inner.fc", "fc2"}
    with pytest.raises(slapo.SlapoError, match="names no"):
        slapo.create_schedule(Outer()).trace(leaf_modules=["no_such_child"])


@pytest.mark.parametrize("tracer", ["pytorch", "huggingface"])
def test_concrete_args(tracer: str) -> None:
    torch.manual_seed(0)
    model = Scaled()
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    gm = sch.trace(flatten=True, tracer=tracer, concrete_args={"scale": None}, config=None)
    assert not any(n.op == "call_function" and "mul" in str(n.target) for n in gm.graph.nodes)
    _check_same(gm, ref, torch.randn(3, 8))


def test_gpt2_block_huggingface_options() -> None:
    """Slapo's transformers schedule line on a tiny GPT-2: fx cannot trace the block (its forward
    takes ``**kwargs``), so torch.export does, with the inputs captured from the model's run."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=32, n_head=4, n_layer=2, vocab_size=64, n_positions=16,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2Model(config).eval()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 8))
    sch = slapo.create_schedule(model, example_inputs={"input_ids": ids})
    gm = sch["h.0"].trace(
        recursive=False,
        flatten=True,
        tracer="huggingface",
        concrete_args={"cache": None},
        config=config,
        leaf_modules=["GPT2Attention"],
    )
    assert _modules_called(gm) == {"ln_1", "attn", "ln_2", "mlp"}
    assert type(gm.get_submodule("attn")).__name__ == "GPT2Attention"
    assert type(gm.get_submodule("mlp")).__name__ == "GPT2MLP"
    built, _ = slapo.build(sch)
    out, expected = built(ids).last_hidden_state, ref(ids).last_hidden_state
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    grads = dict(ref.named_parameters())
    for name, p in built.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)
