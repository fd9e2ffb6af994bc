"""Verify on 2 gloo ranks: sharded gradients are compared slice by slice; a missing sync is named."""

from __future__ import annotations

import pytest

from dist_utils import check_all, run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _verify_job(rank: int, world: int) -> dict[str, str]:
    import torch
    from torch import nn

    import slapo

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    report = {}
    # Gloo ranks run on the CPU: pin Verify there (its default, "cuda", would pick a GPU if any).
    sch = slapo.create_schedule(mlp())
    with slapo.Verify(sch, x, device="cpu"):
        sch["0"].shard("weight", axis=0)
        sch["0"].shard("bias", axis=0)
        sch["0"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        sch["2"].shard("weight", axis=1)
        sch["2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    report["sharded"] = str(tuple(sch["0"].mod.weight.shape))

    def tensor_parallel(sch):
        sch["0"].shard("weight", axis=0)
        sch["0"].shard("bias", axis=0)
        sch["0"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        sch["2"].shard("weight", axis=1)

    sch = slapo.create_schedule(mlp())
    try:
        with slapo.Verify(sch, x, device="cpu"):
            tensor_parallel(sch)
            sch["2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
            sch["1"].replace(nn.ReLU())  # the TP part verifies; this one breaks it
    except slapo.verify.VerificationError as err:
        report["wrong_op"] = str(err)

    sch = slapo.create_schedule(mlp())
    try:
        with slapo.Verify(sch, x, device="cpu"):
            tensor_parallel(sch)  # the fwd_post all_reduce on "2" is missing
    except slapo.verify.VerificationError as err:
        report["missing_sync"] = str(err)
    return report


def test_verify_compares_shards_and_names_where_a_tp_schedule_breaks():
    reports = check_all(run_workers(_verify_job, world=2, timeout=60, deadline=180))
    for report in reports:
        assert report["sharded"] == "(8, 8)"  # half of the 16 output features
        assert 'replace(<ReLU>) on "1"' in report["wrong_op"]
        assert "output 0 differs" in report["missing_sync"]
