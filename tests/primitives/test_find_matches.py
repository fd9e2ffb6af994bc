"""``find`` returns what Slapo code indexes: a list of matches, each a sequence of
``(path, node)`` pairs; the match still carries ``nodes``, ``inputs`` and ``output``."""

from __future__ import annotations

import copy
import operator

import torch
import torch.nn.functional as F
from torch import fx

import slapo
from graph_models import MLP, Attention, FusedQKV, assert_same
from hf_models import assert_same_step, make, twin

X = torch.randn(2, 5, 16)


def bias_gelu(x, bias):  # the pattern of Slapo's BERT and GPT schedules
    x = F.gelu(bias + x)
    return x


def test_a_match_is_indexed_as_path_node_pairs():
    torch.manual_seed(0)
    model = MLP()
    sch = slapo.create_schedule(model)
    sch["linear1"].decompose()
    sch.trace(flatten=True)

    subgraphs = sch.find(bias_gelu)
    assert isinstance(subgraphs, list) and len(subgraphs) == 1
    assert len(subgraphs[0]) == 2  # the add and the gelu
    path, node = subgraphs[0][0]
    assert path == "" and isinstance(node, fx.Node)
    assert subgraphs[0][0][1].target is operator.add
    assert [n.target for _, n in subgraphs[0]] == [operator.add, subgraphs[0][-1][1].target]
    assert subgraphs[0][1:] == [subgraphs[0][1]]  # a slice: a list of pairs
    # What the match said before stays: its nodes, the pattern's inputs and the output node.
    match = subgraphs[0]
    assert match.nodes == [n for _, n in match] and match.output is match.nodes[-1]
    assert match.path == "" and len(match.inputs) == 2
    assert node in match and ("", node) in match and ("other", node) not in match


def test_matches_of_a_regex_in_a_traced_child_carry_its_path():
    sch = slapo.create_schedule(torch.nn.Sequential(Attention()))
    sch.trace(tracer="fx")  # the Attention becomes a child GraphModule "0"
    subgraphs = sch.find(r"[qkv]_proj")
    assert [len(s) for s in subgraphs] == [1, 1, 1]
    assert [s[0][0] for s in subgraphs] == ["0", "0", "0"]
    assert [s[0][1].target for s in subgraphs] == ["q_proj", "k_proj", "v_proj"]


def test_slapo_code_indexing_the_matches_schedules_an_equivalent_attention():
    torch.manual_seed(0)
    ref = Attention()
    model = copy.deepcopy(ref)
    sch = slapo.create_schedule(model)
    sch.trace(tracer="fx")
    subgraphs = sch.find(r"[qkv]_proj")
    # Slapo code reads the matched modules off the nodes to build the fused projection.
    linears = [sch.mod.get_submodule(s[0][1].target) for s in subgraphs]
    sch.replace(FusedQKV(*linears), subgraphs, name="FusedQKV")
    loss_ref, g_ref = step_of(ref)
    loss, g = step_of(sch.mod)
    # One matmul instead of three: another BLAS blocking, so float32 tolerance.
    torch.testing.assert_close(loss, loss_ref)
    qkv = torch.cat([g_ref[f"{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(g["FusedQKV_0.weight"], qkv)
    torch.testing.assert_close(g["out_proj.weight"], g_ref["out_proj.weight"])


def test_slapo_bert_schedule_fuses_bias_gelu_in_every_layer():
    ref = make("bert")
    model = twin(ref)
    sch = slapo.create_schedule(model)
    for i in range(model.config.num_hidden_layers):
        sub = sch[f"bert.encoder.layer.{i}.intermediate"]
        sub["dense"].decompose()
        sub.trace(flatten=True)
        subgraphs = sub.find(bias_gelu)
        assert len(subgraphs) == 1 and len(subgraphs[0]) == 2, subgraphs
        assert subgraphs[0][0][1].target is operator.add
        sub.fuse(subgraphs, compiler="TorchScript", name="BiasGeLU")
        assert "BiasGeLU_0" in sub.child
    # Decomposed matmul + add and a scripted GELU round differently: float32 tolerance.
    assert_same_step(ref, model, exact=False)


def test_the_fused_mlp_matches_the_unscheduled_one():
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    sch = slapo.create_schedule(model)
    sch["linear1"].decompose()
    subgraphs = sch.find(bias_gelu)  # traces by need
    sch.fuse(subgraphs, compiler=None, name="BiasGeLU")
    assert_same(ref, sch.mod, X)  # matmul then add vs addmm: float32 tolerance


def step_of(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from graph_models import step

    return step(model, X)
