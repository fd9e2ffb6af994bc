"""Primitives and ops as published Slapo code calls them (Slapo's tutorials and README):
``replace(op, subgraph, concrete_args=...)``, ``slapo.op.Print``, ``fuse(..., compiler=None,
name=...)``, ``shard``'s ``param.orig_shape`` and ``slapo.op.FusedMLP(..., use_torchscript=...)``.
Each scheduled model is checked against the unscheduled one: output, loss and every gradient."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import slapo
from dist_utils import check_all, run_workers
from slapo.op.attention import FlashAttentionOp

HIDDEN, HEADS = 16, 4


def run_step(
    model: nn.Module, x: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, dict[nn.Parameter, torch.Tensor], torch.Tensor]:
    """Output, loss, each parameter's gradient (keyed by the parameter) and the input's."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = model(x)
    loss = loss_fn(out)
    loss.backward()
    grads = {p: p.grad for p in model.parameters()}
    return out.detach(), loss.detach(), grads, x.grad


def assert_equivalent(
    model: nn.Module,
    ref: nn.Module,
    x: torch.Tensor,
    names: dict[nn.Parameter, str],
    seed: int = 0,
    **tol: float,
) -> None:
    """``model`` computes what ``ref`` does on ``x``: output, loss and every gradient. ``names``
    gives the name in ``ref`` of each parameter of ``model`` (they move when scheduled). Both
    run after ``torch.manual_seed(seed)``: their dropout masks are drawn alike."""

    def loss_fn(out: torch.Tensor) -> torch.Tensor:  # weighted: every output element counts
        return (out * torch.linspace(-1.0, 1.0, out.shape[-1])).pow(2).mean()

    torch.manual_seed(seed)
    out, loss, grads, x_grad = run_step(model, x, loss_fn)
    torch.manual_seed(seed)
    ref_out, ref_loss, ref_grads, ref_x_grad = run_step(ref, x, loss_fn)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(loss, ref_loss, **tol)
    torch.testing.assert_close(x_grad, ref_x_grad, **tol)
    by_name = {n: ref_grads[p] for n, p in ref.named_parameters()}
    assert sorted(names[p] for p in grads) == sorted(by_name)
    for p, grad in grads.items():
        name = names[p]
        torch.testing.assert_close(grad, by_name[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


def own_names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {p: n for n, p in model.named_parameters()}


# ---- 1. replace(new_module, subgraph, concrete_args=...) ------------------------------------------
def scaled_dot_product(q, k, v):
    # The tutorial's core attention, runnable eagerly too (its dropout is off: the unscheduled
    # model is the oracle, and the replacement's dropout draws other random numbers).
    d_k = q.shape[-1]
    attn_score = torch.matmul(q, k.transpose(-2, -1)) / d_k**0.5
    attn_probs = F.softmax(attn_score, dim=-1)
    attn_probs = F.dropout(attn_probs, 0.1, training=False)
    return torch.matmul(attn_probs, v)


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN)

    def permute_for_scores(self, x):
        return x.view(x.shape[:-1] + (HEADS, -1)).permute(0, 2, 1, 3)

    def forward(self, hidden_states):
        q = self.permute_for_scores(self.q_proj(hidden_states))
        k = self.permute_for_scores(self.k_proj(hidden_states))
        v = self.permute_for_scores(self.v_proj(hidden_states))
        out = scaled_dot_product(q, k, v)
        return out.permute(0, 2, 1, 3).flatten(2)


def attention_with_flash_op() -> tuple[SelfAttention, slapo.Schedule, FlashAttentionOp]:
    torch.manual_seed(0)
    ref = SelfAttention()
    sch = slapo.create_schedule(copy.deepcopy(ref))
    found = sch.find(scaled_dot_product)
    assert len(found) == 1, found
    flash_attn = FlashAttentionOp(attn_op_name="native_xformers", apply_causal_mask=False)
    name = sch.replace(flash_attn, found, concrete_args={"attention_mask": None, "p": 0.1})
    assert name == "FlashAttentionOp_0" and sch[name].mod is flash_attn
    return ref, sch, flash_attn


def test_replace_binds_concrete_args_the_subgraph_does_not_supply():
    ref, sch, _ = attention_with_flash_op()
    calls = [n for n in sch.mod.graph.nodes if n.op == "call_module"]
    call = next(n for n in calls if n.target == "FlashAttentionOp_0")
    assert len(call.args) == 3  # q, k, v from the subgraph; the rest bound by name
    assert call.kwargs == {"attention_mask": None, "p": 0.1}
    assert not any(n.target in (torch.matmul, F.softmax) for n in sch.mod.graph.nodes)
    x = torch.randn(2, 5, HIDDEN)
    # Eval mode: no dropout on either side (FlashAttentionOp's p applies in training only).
    assert_equivalent(sch.mod.eval(), ref.eval(), x, own_names(sch.mod))


def test_replace_concrete_dropout_p_reaches_the_op_in_training():
    ref, sch, _ = attention_with_flash_op()
    x = torch.randn(2, 5, HIDDEN)
    torch.manual_seed(1)
    out = sch.mod.train()(x)
    # Plain PyTorch: the same projections, then SDPA with the bound dropout p=0.1, same seed.
    q, k, v = (ref.permute_for_scores(m(x)) for m in (ref.q_proj, ref.k_proj, ref.v_proj))
    torch.manual_seed(1)
    expected = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    torch.testing.assert_close(out, expected.permute(0, 2, 1, 3).flatten(2))
    torch.manual_seed(1)
    undropped = F.scaled_dot_product_attention(q, k, v).permute(0, 2, 1, 3).flatten(2)
    assert not torch.allclose(out, undropped)


def test_replace_rejects_concrete_args_it_cannot_bind():
    for concrete, message in [
        ({"mask": None}, "has no|takes no keyword argument 'mask'"),
        ({"key": None}, "already passes it"),
        ({"p": 0.1, "attention_mask": None, "value": None}, "already passes it"),
    ]:
        torch.manual_seed(0)
        sch = slapo.create_schedule(SelfAttention())
        found = sch.find(scaled_dot_product)
        with pytest.raises(slapo.PrimitiveError, match=message):
            sch.replace(FlashAttentionOp(), found, concrete_args=concrete)
        assert len(sch.find(scaled_dot_product)) == 1  # the graph is unchanged
    sch = slapo.create_schedule(SelfAttention())
    with pytest.raises(slapo.PrimitiveError, match="only apply when replacing a subgraph"):
        sch["q_proj"].replace(nn.Linear(HIDDEN, HIDDEN), concrete_args={"p": 0.1})


# ---- 2. slapo.op.Print ---------------------------------------------------------------------------
class MLPWithPrint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.print = slapo.op.Print()
        self.linear1 = nn.Linear(HIDDEN, HIDDEN)
        self.activation = nn.GELU()
        self.linear2 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, data):
        out = self.linear1(data)
        out = self.print(out, "linear1 shape\n", out.shape, "\nvalue\n", out)
        out = self.activation(out)
        return self.linear2(out)


@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
def test_print_returns_its_first_argument_and_prints_the_rest_at_run_time(traced, capsys):
    torch.manual_seed(0)
    ref = MLPWithPrint()
    sch = slapo.create_schedule(copy.deepcopy(ref))
    if traced:
        sch.trace()
        assert isinstance(sch.mod, fx.GraphModule)
        prints = [n for n in sch.mod.graph.nodes if n.target == "print"]
        assert len(prints) == 1 and [u.target for u in prints[0].users] == ["activation"]
    model, _ = slapo.build(sch, init_weights=False)
    x = torch.randn(2, 3, HIDDEN)
    capsys.readouterr()
    model(x)
    printed = capsys.readouterr().out
    ref(x)
    assert printed == capsys.readouterr().out  # what the unscheduled model prints
    # The message, then the values of linear1's output (not the first argument itself).
    linear1 = ref.linear1(x)
    assert printed == f"linear1 shape\n {linear1.shape} \nvalue\n {linear1}\n", printed
    assert "torch.Size([2, 3, 16])" in printed
    assert_equivalent(model, ref, x, own_names(model))


def test_print_is_an_identity_on_its_first_argument():
    x = torch.randn(3)
    assert slapo.op.Print()(x, "message", x.shape, x) is x
    assert slapo.op.Print("tag", stats=True)(x) is x


# ---- 3. fuse(subgraph, compiler=None, name=...) --------------------------------------------------
class ConvBNReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.head = nn.Linear(4, HIDDEN)

    def forward(self, x):
        x = self.relu(self.bn(self.conv(x)))
        return self.head(x.mean(dim=(2, 3)))


def conv_bn_relu(x):
    return F.relu(slapo.pattern.call_module("bn", slapo.pattern.call_module("conv", x)))


@pytest.mark.parametrize("compiler", [None, "TorchScript"])
def test_fuse_makes_a_container_of_the_fused_modules_named_0_1_2(compiler):
    torch.manual_seed(0)
    ref = ConvBNReLU()
    model = copy.deepcopy(ref)
    sch = slapo.create_schedule(model)
    sch.trace()
    subgraph = sch.find(conv_bn_relu)
    assert len(subgraph) == 1
    called = [n.target for _, n in subgraph[0] if n.op == "call_module"]
    assert called == ["conv", "bn", "relu"]
    modules = [sch.mod.get_submodule(t) for t in called]
    names = own_names(sch.mod)
    assert sch.fuse(subgraph, compiler=compiler, name="ConvBNReLU") == ["ConvBNReLU_0"]

    fused = sch["ConvBNReLU_0"].mod
    children = list(fused.named_children())
    assert [n for n, _ in children] == ["0", "1", "2"]
    if compiler is None:
        assert type(fused).__name__ == "ConvBNReLU" and isinstance(fused, fx.GraphModule)
        assert all(c is m for (_, c), m in zip(children, modules, strict=True))
        targets = [n.target for n in fused.graph.nodes if n.op == "call_module"]
        assert targets == ["0", "1", "2"]
    else:
        assert isinstance(fused, torch.jit.ScriptModule)
    assert [n.target for n in sch.mod.graph.nodes if n.op == "call_module"] == [
        "ConvBNReLU_0",
        "head",
    ]
    assert not hasattr(sch.mod, "conv") and not hasattr(sch.mod, "bn")
    assert sorted(n for n, _ in sch.mod.named_parameters()) == sorted(
        ["ConvBNReLU_0.0.weight", "ConvBNReLU_0.0.bias", "ConvBNReLU_0.1.weight"]
        + ["ConvBNReLU_0.1.bias", "head.weight", "head.bias"]
    )
    # Training-mode batch norm on both sides: the same batch statistics and gradients.
    x = torch.randn(2, 3, 6, 6)
    if compiler is None:
        assert_equivalent(sch.mod, ref, x, names)
    else:  # a scripted graph may reorder float operations: float32 tolerance
        assert_equivalent(sch.mod, ref, x, names, rtol=1e-5, atol=1e-5)
    bn = sch.mod.get_submodule("ConvBNReLU_0.1")
    torch.testing.assert_close(bn.running_mean, ref.bn.running_mean)


# ---- 4. shard records param.orig_shape (2 gloo ranks) --------------------------------------------
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.activation = nn.GELU()
        self.linear2 = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, data):
        return self.linear2(self.activation(self.linear1(data)))


def sharded_mlp_job(rank: int, world: int) -> dict[str, tuple[int, ...]]:
    torch.manual_seed(0)
    ref = MLP()
    sch = slapo.create_schedule(copy.deepcopy(ref))
    sch["linear1"].shard("weight", axis=0)
    sch["linear1"].shard("bias", axis=0)
    sch["linear2"].shard("weight", axis=1)
    sch["linear2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    sch["linear1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    model, _ = slapo.build(sch, init_weights=False)
    params = dict(model.named_parameters())
    for name in ("linear1.weight", "linear1.bias", "linear2.weight"):
        orig = params[name].orig_shape
        assert type(orig) is torch.Size and orig == ref.get_parameter(name).shape, (name, orig)
    assert not hasattr(params["linear2.bias"], "orig_shape")  # not sharded

    x = torch.randn(4, 8, HIDDEN, requires_grad=True)
    out = model(x)
    loss = out.pow(2).mean()
    loss.backward()
    xr = x.detach().clone().requires_grad_()
    ref_out = ref(xr)
    ref_loss = ref_out.pow(2).mean()
    ref_loss.backward()
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(x.grad, xr.grad)
    part = 4 * HIDDEN // world
    mine = slice(rank * part, (rank + 1) * part)
    expected = {
        "linear1.weight": ref.linear1.weight.grad[mine],
        "linear1.bias": ref.linear1.bias.grad[mine],
        "linear2.weight": ref.linear2.weight.grad[:, mine],
        "linear2.bias": ref.linear2.bias.grad,
    }
    assert sorted(params) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(params[name].grad, grad, msg=lambda m, n=name: f"{n}: {m}")
    return {name: tuple(p.shape) for name, p in params.items()}


@pytest.mark.distributed
def test_shard_records_the_unsharded_shape_as_orig_shape():
    for shapes in check_all(run_workers(sharded_mlp_job, world=2, deadline=120)):
        assert shapes["linear1.weight"] == (2 * HIDDEN, HIDDEN)  # half of each, on each rank
        assert shapes["linear2.weight"] == (HIDDEN, 2 * HIDDEN)


# ---- 5. slapo.op.FusedMLP(hidden, intermediate, orig_act, resid_pdrop, use_torchscript) ------------
class PlainMLP(nn.Module):
    """What FusedMLP computes, in plain PyTorch: fc_in, activation, fc_out, dropout."""

    def __init__(self, act: nn.Module, p: float) -> None:
        super().__init__()
        self.fc_in = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.act = act
        self.fc_out = nn.Linear(4 * HIDDEN, HIDDEN)
        self.dropout = nn.Dropout(p)

    def forward(self, x):
        return self.dropout(self.fc_out(self.act(self.fc_in(x))))


@pytest.mark.parametrize(
    ("orig_act", "act", "use_torchscript", "extra"),
    [
        ("gelu_new", nn.GELU(approximate="tanh"), True, {}),
        ("gelu", nn.GELU(), True, {}),
        # Without TorchScript it is torch.compile (inductor by default: seconds of C++ builds on
        # a CPU; torch.compile's "eager" backend runs the same dynamo graph).
        ("relu", nn.ReLU(), False, {"compiler": "eager"}),
    ],
)
def test_fused_mlp_takes_slapos_arguments_and_equals_the_unfused_mlp(
    orig_act: str, act: nn.Module, use_torchscript: bool, extra: dict
):
    torch.manual_seed(0)
    ref = PlainMLP(act, 0.1)
    mlp = slapo.op.FusedMLP(
        HIDDEN, 4 * HIDDEN, orig_act, 0.1, use_torchscript=use_torchscript, **extra
    )
    assert mlp.compiler == ("TorchScript" if use_torchscript else "eager")
    assert mlp.dropout.p == 0.1 and mlp.activation == orig_act
    mlp.load_state_dict(ref.state_dict())
    names = {p: n for n, p in mlp.named_parameters()}
    x = torch.randn(3, 5, HIDDEN)
    assert_equivalent(mlp.eval(), ref.eval(), x, names, rtol=1e-5, atol=1e-5)
    # Training: the residual dropout draws the same mask as nn.Dropout under the same seed.
    mlp.train()
    ref.train()
    assert_equivalent(mlp, ref, x, names, seed=3, rtol=1e-5, atol=1e-5)
    assert (mlp(x) == 0).any()  # the dropout is on


def test_fused_mlp_argument_errors():
    with pytest.raises(slapo.SlapoError, match="orig_act=.*activation="):
        slapo.op.FusedMLP(8, 16, "gelu", activation="relu")
    with pytest.raises(slapo.SlapoError, match="resid_pdrop"):
        slapo.op.FusedMLP(8, 16, "gelu", True)  # a bias flag where the dropout goes
    with pytest.raises(slapo.SlapoError, match="disagree"):
        slapo.op.FusedMLP(8, 16, use_torchscript=True, compiler="inductor")
