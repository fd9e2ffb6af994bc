"""The pipeline target with expert-parallel MoE blocks: 2 pipelines x 2 stages on 4 gloo ranks,
the stages' expert dispatch kept whole by ``slapo.pipeline.expert_trace``."""

from __future__ import annotations

import jobs_pp_ep
import pytest

from dist_utils import assert_check, check_all, run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(200)]


@pytest.fixture(scope="module")
def reports():
    return check_all(run_workers(jobs_pp_ep.job, 4, timeout=60, deadline=150))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_ep_x_pp(reports, family):
    assert_check(reports, f"ep_x_pp_{family}")


def test_dp_replicas_borrowed_by_ep_average_and_clip_over_the_whole_model(reports):
    assert_check(reports, "dp_ep_pp_clip")
