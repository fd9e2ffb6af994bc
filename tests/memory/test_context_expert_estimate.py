"""The memory planner on context- and expert-parallel layouts, against measured real steps.

The estimate of a cp or ep rank is a fake step of the module as that rank runs it, over fake
groups in this process (``slapo.memory.fake_layout_groups``): its attention over a cp group on its
``seq_len / cp`` tokens, its ``num_experts / ep`` experts. The oracle: a real step on gloo ranks
(``cp_ep_jobs.measure``). Parameters, gradients and optimizer state must match exactly; the
activations and the peak within 10% (the estimator's bar). A mixture-of-experts model, which
transformers runs through ``torch._grouped_mm`` (no fake kernel for float32), is estimated too.
"""

from __future__ import annotations

import json

import cp_ep_jobs as J
import pytest
import torch

import slapo
from dist_utils import check_all, run_workers
from slapo.memory import (
    EstimateError,
    LayoutSpec,
    apply_layout,
    estimate_layout,
    fake_layout_groups,
)
from slapo.sharding.context_parallel import context_parallel
from slapo.sharding.expert_grads import reduce_expert_grads
from slapo.sharding.expert_parallel import expert_parallel

EXACT = ("params", "grads", "optimizer_state")


def _within(estimate: int, measured: int, rel: float = 0.10) -> bool:
    return abs(estimate - measured) <= rel * measured


def _check(est: slapo.MemoryEstimate, real: dict[str, int]) -> None:
    assert {k: getattr(est, k) for k in EXACT} == {k: real[k] for k in EXACT}, real
    assert _within(est.activations, real["activations"]), (est.activations, real)
    assert _within(est.peak, real["peak"]), (est.peak, real)


def _cp_estimate(cp: int, **layout: int) -> slapo.MemoryEstimate:
    model = J.llama(meta=True)
    with fake_layout_groups(cp=cp) as groups:
        local = context_parallel(model, groups["cp"]).model_batch(J.batch())
        return estimate_layout(model, local, cp=cp, device="cpu", optimizer="adamw", **layout)


def _ep_estimate(ep: int) -> slapo.MemoryEstimate:
    model = J.qwen3_moe(meta=True)
    with fake_layout_groups(ep=ep) as groups:
        expert_parallel(model, groups["ep"])
        reduce_expert_grads(model, None, average_over=ep)
        return estimate_layout(
            model, J.batch(), target="ddp", dp=ep, ep=ep, device="cpu", optimizer="adamw"
        )  # fmt: skip


def test_a_moe_model_is_estimated_within_10_percent_of_its_measured_step():
    # transformers' grouped_mm has no fake kernel for float32: the fake step runs its fallback
    est = slapo.estimate_memory(J.qwen3_moe(meta=True), J.batch(), device="cpu")
    _check(est, J.measure(J.qwen3_moe(), J.batch()))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_each_cp_rank_is_estimated_within_10_percent():
    reports = check_all(run_workers(J.cp_step, 2, deadline=150.0))
    est = _cp_estimate(2)
    whole = slapo.estimate_memory(J.llama(meta=True), J.batch(), device="cpu")
    for real in reports:
        _check(est, real)
    # half the tokens, plus the gathered keys and values (mask-free attention: linear)
    assert 0.4 * whole.activations < est.activations < 0.75 * whole.activations
    assert est.layout == {"dp": 1, "pp": 1, "tp": 1, "cp": 2}
    # eager cp sums the gradients through one flat buffer after the backward: a transient
    assert est.live_peak >= est.peak - est.activations + est.grads


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_each_ep_rank_is_estimated_within_10_percent():
    reports = check_all(run_workers(J.ep_step, 2, deadline=150.0))
    est = _ep_estimate(2)
    whole = slapo.estimate_memory(J.qwen3_moe(meta=True), J.batch(), device="cpu")
    for real in reports:
        _check(est, {**real, "peak": real["peak"] + est.engine})  # + DDP's buckets (modelled)
    # the experts are 1/ep: the parameters drop by half the experts' bytes
    experts = 2 * J.EXPERTS * 3 * 32 * 16 * 4  # layers x experts x (gate, up, down) x H x I x 4 B
    assert whole.params - est.params == experts // 2
    # DDP averages every gradient but the experts' (their hooks reduce those)
    assert est.engine == est.grads - experts // 2
    assert sum(r["rows"] for r in reports) == 2 * 2 * J.BATCH * J.SEQ * J.TOP_K  # layers x ranks


def test_the_layout_must_be_prepared_for_cp_and_ep():
    model = J.llama(meta=True)
    with pytest.raises(
        EstimateError, match="cp 2: LlamaForCausalLM runs attention 'sdpa'.*context_parallel"
    ):
        estimate_layout(model, J.batch(), target="ddp", cp=2, device="cpu")
    moe = J.qwen3_moe(meta=True)
    with pytest.raises(EstimateError, match=r'ep 2: "model.layers.0.mlp.experts" holds 8 of 8'):
        estimate_layout(moe, J.batch(), target="ddp", dp=2, ep=2, device="cpu")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (dict(target="ddp", dp=3, ep=2), "ep 2 borrows its ranks from dp x cp = 3 x 1"),
        (dict(target="ddp", dp=2, cp=2, ep=2, rank=0), None),
        (dict(target="ddp", dp=1, cp=2, ep=3), "must divide 2 and be a multiple of cp 2"),
        (dict(target="roundpipe", cp=2), "pp, tp, cp and ep must be 1"),
        (dict(target="ddp", cp=0), "cp must be a positive int"),
    ],
)
def test_layout_spec_checks_cp_and_ep(spec, message):
    if message is None:
        made = LayoutSpec(**spec)
        assert (made.world, made.replicas, made.describe()) == (
            4,
            4,
            "ddp dp2 x pp1 x cp2 x tp1 ep2",
        )
        return
    with pytest.raises(EstimateError, match=message):
        LayoutSpec(**spec)


def test_cp_ranks_and_stages_on_the_mesh():
    spec = LayoutSpec("pipeline", pp=2, cp=2, tp=2, rank=6)  # ((dp*pp + stage)*cp + cp)*tp + tp
    assert (spec.coords(), spec.cp_rank) == ((0, 1, 0), 1)
    assert LayoutSpec("fsdp", dp=2, pp=2, tp=2, rank=5).coords() == (1, 0, 1)  # as before


def test_data_parallel_engines_shard_over_dp_times_cp():
    base = slapo.estimate_memory(J.llama(meta=True), J.batch(), device="cpu")
    dp4 = apply_layout(base, J.llama(meta=True), LayoutSpec("fsdp", dp=4))
    fsdp = _cp_estimate(2, target="fsdp", dp=2)  # FSDP2 over the 4 ranks of dp x cp
    assert (fsdp.params, fsdp.grads, fsdp.optimizer_state) == (
        dp4.params, dp4.grads, dp4.optimizer_state,
    )  # fmt: skip
    ddp = _cp_estimate(2, target="ddp")  # dp 1: DDP over the cp group all the same
    assert ddp.engine == ddp.grads == base.grads


def test_slapo_estimate_takes_cp_and_ep(capsys):
    from slapo.cli import main

    assert main(["estimate", "--model", "qwen3_moe", "--cp", "2", "--ep", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["estimate"]
    assert doc["layout"] == {"dp": 1, "pp": 1, "tp": 1, "cp": 2, "ep": 2}
    assert doc["target"] == "ddp"
    assert main(["estimate", "--model", "qwen3_moe", "--json"]) == 0  # no EstimateError
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["estimate"]
    assert doc["params"] < whole["params"] and doc["activations"] < whole["activations"]
    with pytest.raises(SystemExit, match="ep 2 borrows its ranks from dp x cp = 1 x 1"):
        main(["estimate", "--model", "qwen3_moe", "--ep", "2"])


def test_fake_layout_groups_give_each_kind_its_group():
    import torch.distributed as dist

    with fake_layout_groups(tp=2, cp=2, ep=2, tp_rank=1) as groups:
        assert [dist.get_world_size(groups[k]) for k in ("tp", "cp", "ep")] == [2, 2, 2]
        assert [dist.get_rank(groups[k]) for k in ("tp", "cp", "ep")] == [1, 0, 0]
    assert not dist.is_initialized()
    with pytest.raises(EstimateError, match="cp must be a positive int"):
        with fake_layout_groups(cp=0):
            pass


def test_a_run_rank_maps_to_the_estimate_mesh_by_its_coordinates():
    from types import SimpleNamespace

    from slapo.train.run_memory import _spec_rank

    class Mesh:  # the run's ("pp", "dp", "cp", "tp") mesh, as slapo train lays it out
        mesh_dim_names = ("pp", "dp", "cp", "tp")
        mesh = torch.zeros(2, 2, 2, 1)

        def get_coordinate(self) -> list[int]:
            return [1, 0, 1, 0]  # stage 1, dp rank 0, cp rank 1

    rank = _spec_rank(SimpleNamespace(mesh=Mesh(), rank=5))
    spec = LayoutSpec("pipeline", pp=2, cp=2, rank=rank)
    assert (rank, spec.coords(), spec.cp_rank) == (3, (0, 1, 0), 1)
    assert _spec_rank(SimpleNamespace(mesh=None, rank=3)) == 3
