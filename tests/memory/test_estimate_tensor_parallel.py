"""Per-rank estimates of tensor-parallel schedules on 2 gloo ranks, checked against each rank's
measured step (one spawned job for every family)."""

from __future__ import annotations

import pytest
from estimate_jobs import FAMILIES, tp_estimates

from dist_utils import check_all, run_workers


@pytest.fixture(scope="module")
def reports():
    return check_all(run_workers(tp_estimates, 2, deadline=150.0))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_estimates_its_own_share(reports, family):
    for rank, report in enumerate(reports):
        r = report[family]
        assert (r["rank"], r["world"]) == (rank, 2)
        # a rank holds its shards: fewer parameter bytes than the whole model, counted exactly
        assert r["est_params"] == r["real_params"] < 0.8 * r["full_params"]
        assert (r["est_grads"], r["est_state"]) == (r["real_grads"], r["real_state"])
        assert abs(r["est_act"] - r["real_act"]) <= 0.10 * r["real_act"], r
        assert abs(r["est_peak"] - r["real_peak"]) <= 0.10 * r["real_peak"], r
