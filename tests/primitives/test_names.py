"""Fused and replaced subgraphs get Slapo's names: ``<name>_0``, then ``<name>_1``, ...,
reachable as ``sch["<name>_0"]``; the scheduled model still matches the unscheduled one."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import slapo
from graph_models import MLP, Attention, FusedQKV, assert_same, step

X = torch.randn(2, 5, 16)


def bias_gelu(x, bias):
    x = F.gelu(bias + x)
    return x


class BiasGeLU(nn.Module):
    def forward(self, x, bias):
        return F.gelu(bias + x)


def two_mlps() -> tuple[nn.Module, slapo.Schedule]:
    torch.manual_seed(0)
    ref = nn.Sequential(MLP(), MLP())
    model = copy.deepcopy(ref)
    sch = slapo.create_schedule(model)
    for i in range(2):
        sch[f"{i}.linear1"].decompose()
    sch.trace(flatten=True)  # both MLPs in the root's graph: two matches
    return ref, sch


def test_fuse_names_each_match_name_0_name_1():
    ref, sch = two_mlps()
    subgraphs = sch.find(bias_gelu)
    assert len(subgraphs) == 2
    names = sch.fuse(subgraphs, compiler="TorchScript", name="BiasGeLU")
    assert names == ["BiasGeLU_0", "BiasGeLU_1"]
    assert isinstance(sch["BiasGeLU_0"].mod, torch.jit.ScriptModule)
    assert isinstance(sch["BiasGeLU_1"].mod, torch.jit.ScriptModule)
    assert sorted(sch.mod.state_dict()) == sorted(ref.state_dict())  # fusing renames no weight
    assert_same(ref, sch.mod, X)  # matmul + add and a scripted GELU: float32 tolerance


def test_fusing_again_takes_the_next_number():
    ref, sch = two_mlps()
    first, second = sch.find(bias_gelu)
    sch.fuse(first, compiler="TorchScript", name="BiasGeLU")  # one match at a time
    sch.fuse(second, "TorchScript", "BiasGeLU")  # Slapo's positional order
    assert [n for n in sch.child if n.startswith("BiasGeLU")] == ["BiasGeLU_0", "BiasGeLU_1"]
    assert_same(ref, sch.mod, X)


def test_fuse_without_a_name_is_fused_module_0():
    _, sch = two_mlps()
    assert sch.fuse(sch.find(bias_gelu)[0], compiler=None) == ["FusedModule_0"]
    assert "FusedModule_0" in sch.child


def test_partial_replace_is_named_name_0():
    torch.manual_seed(0)
    ref = Attention()
    model = copy.deepcopy(ref)
    sch = slapo.create_schedule(model)
    subgraphs = sch.find(r"[qkv]_proj")  # traces by need
    fused = FusedQKV(model.q_proj, model.k_proj, model.v_proj)
    assert sch.replace(fused, subgraphs, name="FusedQKV") == "FusedQKV_0"
    assert sch["FusedQKV_0"].mod is fused
    loss_ref, g_ref = step(ref, X)
    loss, g = step(sch.mod, X)
    # One matmul instead of three: another BLAS blocking, float32 tolerance.
    torch.testing.assert_close(loss, loss_ref)
    for kind in ("weight", "bias"):
        stacked = torch.cat([g_ref[f"{p}_proj.{kind}"] for p in "qkv"])
        torch.testing.assert_close(g[f"FusedQKV_0.{kind}"], stacked)
        torch.testing.assert_close(g[f"out_proj.{kind}"], g_ref[f"out_proj.{kind}"])


def test_partial_replace_without_a_name_uses_the_class_name_and_counts_up():
    ref, sch = two_mlps()
    for subgraph in sch.find(bias_gelu):
        sch.replace(BiasGeLU(), subgraph)
    assert [n for n in sch.child if n.startswith("BiasGeLU")] == ["BiasGeLU_0", "BiasGeLU_1"]
    assert_same(ref, sch.mod, X)  # matmul then add vs addmm: float32 tolerance
