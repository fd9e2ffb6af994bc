"""Slapo's four documentation tutorials, re-created as Slapo user code writes them: the quick
start on a Hugging Face BERT, the single-device attention/MLP tutorial, the multi-device MLP
tutorial (2 gloo ranks) and debugging with ``Print``. Every flow that runs a model checks it
against the unscheduled one: the loss and every gradient (a sharded gradient against its slice)."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from tutorial_jobs import HEADS, HIDDEN, MLP, bias_gelu_pattern, tensor_parallel_mlp_job

import slapo
from dist_utils import check_all, run_workers
from slapo.op.attention import FlashAttentionOp


def assert_grads(model: nn.Module, ref: nn.Module, rename=None) -> None:
    """Every gradient of ``ref`` equals the one of the same parameter in ``model``."""
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        mine = got[rename(name) if rename else name]
        torch.testing.assert_close(mine.grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")


# ---- 1. Quick start: a Hugging Face BERT ---------------------------------------------------------
def bert_config():
    transformers = pytest.importorskip("transformers")  # the other tutorials run without it
    return transformers.BertConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=4 * HIDDEN,
        num_hidden_layers=2, vocab_size=64, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip


class SelfAttention(nn.Module):
    """The user's own attention core for BERT: separate projections and Slapo's attention op."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.attn_op = FlashAttentionOp("cuda")  # FlashAttention on a GPU, SDPA on a CPU

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        b, s, h = hidden_states.shape

        def heads(t):
            return t.view(b, s, self.num_heads, h // self.num_heads).transpose(1, 2)

        q = heads(self.query(hidden_states))
        k = heads(self.key(hidden_states))
        v = heads(self.value(hidden_states))
        out = self.attn_op(q, k, v, attention_mask)
        return out.transpose(1, 2).reshape(b, s, h), None


def replace_attention(sch: slapo.Schedule, config) -> None:
    for idx in range(config.num_hidden_layers):
        sub_sch = sch[f"encoder.layer.{idx}.attention.self"]
        new_mod = SelfAttention(config)
        new_mod.load_state_dict(sub_sch.mod.state_dict())  # the same weights as BERT's
        sub_sch.replace(new_mod)


def test_quick_start_bert():
    torch.manual_seed(0)
    config = bert_config()
    config._attn_implementation = "eager"
    reference = pytest.importorskip("transformers").BertModel(config)
    model = copy.deepcopy(reference)
    sch = slapo.create_schedule(model)

    # Replace the attention core with the user's module running slapo.op's attention.
    replace_attention(sch, config)
    assert isinstance(sch["encoder.layer.0.attention.self.attn_op"].mod, FlashAttentionOp)

    # Trace layer 0's attention with the Hugging Face tracer and fuse the q/k/v projections.
    attn = sch["encoder.layer.0.attention"]
    gm = attn.trace(
        tracer="huggingface",
        flatten=True,
        concrete_args={"encoder_hidden_states": None, "encoder_attention_mask": None},
        config=config,
    )
    assert isinstance(gm, fx.GraphModule)
    subgraphs = attn.find(r"self.(query|key|value)")
    assert len(subgraphs) == 3 and all(len(m) == 1 for m in subgraphs)
    assert sorted(m[0][1].target for m in subgraphs) == ["self.key", "self.query", "self.value"]
    assert all(m[0][1].op == "call_module" for m in subgraphs)
    qkv = slapo.op.FusedQKV.from_linears(
        model.encoder.layer[0].attention.self.query,
        model.encoder.layer[0].attention.self.key,
        model.encoder.layer[0].attention.self.value,
        num_heads=HEADS,
    )
    # flatten=True: the matches are nodes of the attention's own graph (path "").
    assert [m[0][0] for m in subgraphs] == ["", "", ""]
    assert attn.replace(qkv, subgraphs, name="FusedQKV") == "FusedQKV_0"
    assert sch["encoder.layer.0.attention.FusedQKV_0"].mod is qkv

    # Fuse bias + GeLU of layer 0's intermediate MLP.
    sch["encoder.layer.0.intermediate.dense"].decompose()
    sch["encoder.layer.0.intermediate"].trace(tracer="huggingface", flatten=True, config=config)
    subgraph = sch["encoder.layer.0.intermediate"].find(bias_gelu_pattern)
    assert len(subgraph) == 1
    assert [n.target for _, n in subgraph[0]][-1] in (F.gelu, torch._C._nn.gelu), subgraph
    sch["encoder.layer.0.intermediate"].fuse(subgraph, compiler="TorchScript", name="BiasGeLU")
    assert isinstance(sch["encoder.layer.0.intermediate.BiasGeLU_0"].mod, torch.jit.ScriptModule)

    # Checkpoint the second layer, then build and train a few steps.
    sch["encoder.layer.1"].checkpoint()
    built, optimizer = slapo.build(
        sch,
        init_weights=model._init_weights,
        optimizer=torch.optim.SGD,
        optimizer_kwargs={"lr": 0.1},
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    prefix = "encoder.layer.0.attention.self."
    qkv_names = {prefix + p for p in ("query.weight", "query.bias", "key.weight", "key.bias")}
    qkv_names |= {prefix + "value.weight", prefix + "value.bias"}
    data = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=data)
        weight = torch.linspace(-1, 1, HIDDEN)
        loss = (built(ids).last_hidden_state * weight).pow(2).mean()
        loss.backward()
        ref_loss = (reference(ids).last_hidden_state * weight).pow(2).mean()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        got = dict(built.named_parameters())
        for name, p in reference.named_parameters():
            if name not in qkv_names:
                torch.testing.assert_close(
                    got[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}"
                )
        fused = built.get_submodule("encoder.layer.0.attention.FusedQKV_0")
        for kind in ("weight", "bias"):
            ref_grads = [
                reference.get_parameter(f"{prefix}{p}.{kind}").grad
                for p in ("query", "key", "value")
            ]
            for got_grad, ref_grad in zip(fused.split(getattr(fused, kind).grad), ref_grads):
                torch.testing.assert_close(got_grad, ref_grad)
        optimizer.step()
        optimizer.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))


# ---- 2. Optimize attention and MLP on one device --------------------------------------------------
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN)
        self.out_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, HEADS, HIDDEN // HEADS).transpose(1, 2)
        k = self.k_proj(x).view(b, s, HEADS, HIDDEN // HEADS).transpose(1, 2)
        v = self.v_proj(x).view(b, s, HEADS, HIDDEN // HEADS).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) / (HIDDEN // HEADS) ** 0.5
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, HIDDEN))


class AttnMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class EfficientAttention(Attention):
    """The attention rewritten with Slapo's attention op (same parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.core = FlashAttentionOp("cuda")

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, HEADS, HIDDEN // HEADS).transpose(1, 2)
        k = self.k_proj(x).view(b, s, HEADS, HIDDEN // HEADS).transpose(1, 2)
        v = self.v_proj(x).view(b, s, HEADS, HIDDEN // HEADS).transpose(1, 2)
        out = self.core(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, HIDDEN))


def test_attention_and_mlp_on_one_device():
    torch.manual_seed(0)
    reference = AttnMLP()
    model = copy.deepcopy(reference)
    sch = slapo.create_schedule(model)
    x = torch.randn(2, 8, HIDDEN)
    with slapo.Verify(sch, x, device="cpu"):
        # The attention: the user's efficient module, with the original weights.
        new_attn = EfficientAttention()
        new_attn.load_state_dict(sch["attn"].mod.state_dict())
        sch["attn"].replace(new_attn)
        # The MLP: decompose linear1, trace, find bias + GeLU, fuse it.
        sch["mlp.linear1"].decompose()
        sch["mlp"].trace(flatten=True)
        subgraph = sch["mlp"].find(bias_gelu_pattern)
        assert len(subgraph) == 1
        nodes = [node for _, node in subgraph[0]]
        # The functional pattern matches the model's nn.GELU module call.
        assert [(n.op, n.target) for n in nodes][-1] == ("call_module", "activation"), nodes
        assert len(nodes) == 2 and nodes[0].target in ("add", torch.add, operator.add)
        assert all(isinstance(path, str) for path, _ in subgraph[0])
        sch["mlp"].fuse(subgraph, compiler="TorchScript", name="BiasGeLU")
    assert isinstance(sch["mlp.BiasGeLU_0"].mod, torch.jit.ScriptModule)
    assert "BiasGeLU_0" in [n.target for n in sch["mlp"].mod.graph.nodes if n.op == "call_module"]
    assert isinstance(sch["attn.core"].mod, FlashAttentionOp)

    built, _ = slapo.build(sch)
    loss = built(x).pow(2).mean()
    loss.backward()
    ref_loss = reference(x).pow(2).mean()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    assert_grads(built, reference)


# ---- 3. Multi-device MLP (tensor parallel, 2 gloo ranks) ------------------------------------------
@pytest.mark.distributed
def test_tensor_parallel_mlp_on_two_gloo_ranks():
    for nodes in check_all(run_workers(tensor_parallel_mlp_job, world=2, deadline=120)):
        assert "BiasGeLU_0" in nodes and "linear2" in nodes, nodes


# ---- 4. Debugging with Print ----------------------------------------------------------------------
class PrintMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(HIDDEN, 3)
        self.linear2 = nn.Linear(3, HIDDEN)
        self.print = slapo.op.Print()

    def forward(self, x):
        out = self.linear1(x)
        self.print(out, "linear1 shape\n", out.shape, "\nvalue\n", out)
        return self.linear2(out)


def test_debug_with_print(capsys):
    torch.manual_seed(0)
    reference = PrintMLP()
    sch = slapo.create_schedule(copy.deepcopy(reference))
    capsys.readouterr()
    sch.trace()
    assert capsys.readouterr().out == ""  # nothing printed while tracing
    assert isinstance(sch.mod, fx.GraphModule)
    calls = [n for n in sch.mod.graph.nodes if n.op == "call_module" and n.target == "print"]
    assert len(calls) == 1, sch.mod.graph
    model, _ = slapo.build(sch)

    x = torch.randn(4, HIDDEN)
    capsys.readouterr()
    loss = model(x).pow(2).mean()
    printed = capsys.readouterr().out
    ref_loss = reference(x).pow(2).mean()
    eager = capsys.readouterr().out
    assert printed == eager, (printed, eager)
    assert "linear1 shape\n torch.Size([4, 3]) \nvalue\n tensor([[" in printed, printed
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    assert_grads(model, reference)
