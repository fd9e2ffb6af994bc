"""The ready schedules with group= on 2 gloo ranks match one process (one spawned job)."""

from __future__ import annotations

import pytest
from schedule_jobs import tp_job

from dist_utils import check_all, run_workers

NAMES = [
    "gpt2", "llama", "bert", "opt", "t5", "qwen2 (biased q/k/v)", "gpt2 sequence parallel",
    "llama tp + ckpt + sdpa + fused loss", "bert tp + fuse_ops + ckpt",
    "t5 tp + ckpt + eager attention", "llama heads that do not divide: clear error",
]  # fmt: skip


@pytest.fixture(scope="module")
def reports():
    return check_all(run_workers(tp_job, 2, deadline=150.0))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", NAMES)
def test_tensor_parallel_schedule_matches_one_process(reports, name):
    errors = [f"rank {r}:\n{rep[name]}" for r, rep in enumerate(reports) if rep[name]]
    assert not errors, "\n".join(errors)
