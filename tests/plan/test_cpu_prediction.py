"""The planner's CPU path (benchmarks/plan_step_time.py): the main job predicted on this host.

Structure only: the prediction runs on the CPU (the fake step on the CPU, a calibrated device
that has no TF32 peak), gives a positive step with the expected terms, and ranks sharing the
host's cores compute at their share of its rates. No timing is asserted.
"""

from __future__ import annotations

import dataclasses

import pytest

from slapo.initialization import init_empty_weights
from slapo.plan.hardware import ClusterSpec, DeviceSpec, DeviceSpecError, Link
from slapo.plan.search import predict_config
from slapo.train.config import TrainConfig
from slapo.train.presets import build_model

#: A device as calibrate_device("cpu", dtype="fp32") writes it: measured rates as the peaks,
#: fp32 and bf16 only (no TF32 on a CPU), fractions of 1 but attention's.
CPU = DeviceSpec(
    "cpu-calibrated", {"fp32": 0.1, "bf16": 0.2}, hbm_gib=16.0, hbm_gbps=20.0,
    intra_node=Link(1.0, 300.0),
    efficiency={"matmul": 1.0, "attention": 0.1, "memory": 1.0, "collective": 1.0},
)  # fmt: skip


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> TrainConfig:
    """The main job's TrainConfig on the CPU, its model a config-only directory."""
    cfg = TrainConfig(device="cpu", progress=False)
    with init_empty_weights():
        model = build_model(cfg, weights=False)
    path = tmp_path_factory.mktemp("llama-tiny")
    model.config.save_pretrained(path)
    return dataclasses.replace(cfg, model=str(path))


def test_eager_main_job_is_predicted_on_the_cpu(main_job: TrainConfig) -> None:
    cluster = ClusterSpec(CPU, gpus_per_node=1, shared_cores=2, threads_per_rank=2)
    pred = predict_config(main_job, cluster, dp=1)
    assert pred.seconds > 0
    assert pred.memory.device == "cpu"  # the fake step ran where the run trains
    assert {"matmul (forward)", "matmul (backward)", "attention (forward)",
            "attention (backward)", "memory-bound (forward)", "memory-bound (backward)",
            "memory-bound (optimizer)"} <= set(pred.time_terms)  # fmt: skip
    # one process: no collective, no pipeline
    assert not any("all-" in k or "pipeline" in k for k in pred.time_terms)
    assert pred.seconds == pytest.approx(sum(pred.time_terms.values()))


def test_ranks_sharing_the_cores_compute_at_their_share(main_job: TrainConfig) -> None:
    ddp = dataclasses.replace(main_job, target="ddp")
    own = predict_config(ddp, ClusterSpec(CPU, gpus_per_node=2), dp=2, cache={})
    shared = predict_config(
        ddp, ClusterSpec(CPU, gpus_per_node=2, shared_cores=2, threads_per_rank=1), dp=2
    )
    for term in ("matmul (forward)", "attention (backward)", "memory-bound (optimizer)"):
        assert shared.time_terms[term] == pytest.approx(2 * own.time_terms[term])
    assert "ddp all-reduce (exposed)" in shared.time_terms


@pytest.mark.parametrize(
    ("ranks", "threads", "share"), [(1, 2, 1.0), (1, 1, 0.5), (2, 1, 0.5), (8, 1, 0.125)]
)
def test_rank_share_splits_the_cores(ranks: int, threads: int, share: float) -> None:
    cluster = ClusterSpec(CPU, gpus_per_node=ranks, shared_cores=2, threads_per_rank=threads)
    assert cluster.rank_share(ranks) == share
    assert ClusterSpec(CPU).rank_share(ranks) == 1.0  # a device per rank


@pytest.mark.parametrize(
    ("field", "value"), [("shared_cores", -1), ("threads_per_rank", 0), ("shared_cores", True)]
)
def test_bad_core_fields_name_the_field(field: str, value: object) -> None:
    with pytest.raises(DeviceSpecError, match=f"ClusterSpec.{field}"):
        ClusterSpec(CPU, **{field: value})
