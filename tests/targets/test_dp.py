"""DDP and FSDP2 targets on gloo processes: 3 optimizer steps equal one process on the batch.

2 ranks: data parallel over every rank; 4 ranks: a 2x2 (data x tensor) mesh. The checks run in
the suite's shared jobs (``conftest.py``).
"""

from __future__ import annotations

import pytest

import hf_models
import slapo
from dist_utils import assert_check
from slapo.exceptions import TargetError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


@pytest.mark.parametrize(
    "check",
    ["ddp_gpt2", "fsdp_gpt2", "fsdp_llama", "fsdp_blocks", "fsdp_mixed_precision", "bad_options"],
)
def test_dp2(ranks2, check):
    assert_check(ranks2, check)


@pytest.mark.parametrize(
    "check", ["ddp_tp_llama", "fsdp_tp_gpt2", "fsdp_tp_replicated_grads", "ddp_tp_replicated_grads"]
)
def test_dp_x_tp(ranks4, check):
    assert_check(ranks4, check)


@pytest.mark.parametrize("target", ["ddp", "fsdp"])
def test_needs_process_group(target):
    sch = slapo.create_schedule(hf_models.make("gpt2"))
    with pytest.raises(TargetError, match="slapo.env.setup"):
        slapo.build(sch, target=target)


def test_deepspeed_without_deepspeed_says_how_to_get_it():
    from slapo.targets.deepspeed import deepspeed_available

    if deepspeed_available():
        pytest.skip("deepspeed is installed")
    sch = slapo.create_schedule(hf_models.make("gpt2"))
    with pytest.raises(TargetError, match="pip install deepspeed"):
        slapo.build(sch, target="deepspeed")


@pytest.mark.parametrize(
    "check",
    ["bf16 ddp", "bf16 fsdp", "bf16 pipeline", "fp16 overflow ddp", "fp16 overflow fsdp"],
)
def test_mixed_precision_2_ranks(ranks2, check):
    """bf16 on ddp, fsdp and pipeline stages equals one process in bf16 (``jobs_precision``:
    the tolerance); fp16's overflow on one rank skips the step on both."""
    assert_check(ranks2, check)
