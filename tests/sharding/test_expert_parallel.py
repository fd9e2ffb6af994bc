"""Expert parallelism across 2 and 4 gloo processes: one process on the global batch is the oracle.

Each job (one spawn of ``ep`` workers) runs every check of ``ep_jobs``; each test reports one.
"""

from __future__ import annotations

import doctest

import ep_jobs as jobs
import pytest

import slapo.sharding.expert_dispatch
from dist_utils import assert_check, check_all, run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

CHECKS = [
    "dispatcher",
    "errors",
    "qwen3_moe_aux",
    "qwen3_moe_global",
    "qwen3_moe_moves",
    "mixtral_aux",
    "mixtral_global",
    "mixtral_moves",
    "qwen2_moe_aux",
    "gpt_oss_aux",
    "deepseek_v3_global",
    "deepseek_v3_moves_bf16",
    "deepseek_v3_checkpoint",
    "gpt_oss_checkpoint",
]


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ep2"))  # the checkpoints the ranks share
    return check_all(run_workers(jobs.ep_job, 2, (root,), timeout=60.0, deadline=120.0))


@pytest.fixture(scope="module")
def ep4(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ep4"))
    return check_all(run_workers(jobs.ep_job, 4, (root,), timeout=60.0, deadline=150.0))


@pytest.mark.parametrize("check", CHECKS)
def test_ep2(ep2, check):
    assert_check(ep2, check)


@pytest.mark.parametrize("check", [*CHECKS, "subgroup_qwen3_moe"])
def test_ep4(ep4, check):
    assert_check(ep4, check)


def test_dispatcher_doctest():
    result = doctest.testmod(slapo.sharding.expert_dispatch)
    assert result.attempted > 0 and result.failed == 0
