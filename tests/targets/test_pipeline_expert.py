"""The pipeline target with expert-parallel MoE blocks: 2 pipelines x 2 stages on 4 gloo ranks,
the stages' expert dispatch kept whole by ``slapo.pipeline.expert_trace``.

The checks (``jobs_pp_ep.py``) run in the suite's shared 4-rank job (``conftest.py``).
"""

from __future__ import annotations

import pytest

from dist_utils import assert_check

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_ep_x_pp(ranks4, family):
    assert_check(ranks4, f"ep_x_pp_{family}")


def test_dp_replicas_borrowed_by_ep_average_and_clip_over_the_whole_model(ranks4):
    assert_check(ranks4, "dp_ep_pp_clip")
