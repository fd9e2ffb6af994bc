"""The "deepspeed" target on gloo processes: ZeRO-1/2/3, DeepSpeed's pipeline engine, TP x ZeRO.

Each check trains with the contract's loop and must give the one-process loss curve and
parameters (and the pipeline the one-process gradients); the checks run in one 2-rank and one
4-rank job (``jobs_deepspeed``). ``slapo train --target deepspeed`` runs under torchrun.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import jobs_deepspeed
import pytest

import hf_models
import slapo
from dist_utils import assert_check, check_all, free_port, run_workers
from slapo.exceptions import SlapoError, TargetError

# find_spec, not importorskip: collecting this file does not pay DeepSpeed's 2 s import
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
)
pytestmark = [needs_deepspeed]
PG_TIMEOUT = 120.0  # a gloo group's timeout: a rank blocked past it raises instead of hanging


@pytest.fixture(scope="module")
def ds2():
    return check_all(run_workers(jobs_deepspeed.job2, 2, timeout=PG_TIMEOUT, deadline=240))


@pytest.fixture(scope="module")
def ds4():
    return check_all(run_workers(jobs_deepspeed.job4, 4, timeout=PG_TIMEOUT, deadline=240))


TWO = ["zero1_gpt2", "zero2_llama", "zero3_gpt2", "other_loops", "pipe_gpt2", "pipe_llama",
       "pipe_bf16", "zero2_bf16", "bad_options", "pipe_batches"]  # fmt: skip
FOUR = ["tp_zero2_llama", "tp_zero3_gpt2", "pipe_dp_zero1_gpt2"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", TWO)
def test_two_ranks(ds2, check):
    assert_check(ds2, check)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", FOUR)
def test_four_ranks(ds4, check):
    assert_check(ds4, check)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_slapo_train_starts_from_the_one_process_loss(tmp_path):
    """torchrun sets LOCAL_RANK; the 2 ranks train on the halves of one process's batch of 4
    (ZeRO-2 averages their gradients): that process's loss curve."""
    from slapo.train import TrainConfig, train

    args = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--no-progress"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "slapo", "train", "--target", "deepspeed",
           *args, "--output-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["config"]["target"] == "deepspeed"
    one = train(TrainConfig(steps=2, batch_size=4, seq_len=16, progress=False))["losses"]
    # float32 tolerance: the same batch, but DeepSpeed's engine may order the sums otherwise
    import torch

    torch.testing.assert_close(metrics["losses"], one, rtol=0, atol=1e-4)


def test_setup_exports_the_launcher_variables_and_teardown_restores_them(monkeypatch):
    """DeepSpeed reads LOCAL_RANK: slapo.env sets what torchrun would, never what is set."""
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")  # the user's value: kept
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    port = str(free_port())
    slapo.env.setup(rank=0, world_size=1, backend="gloo", master_port=int(port), timeout=60)
    try:
        exported = slapo.env.export_env(local_rank=5)
        assert exported == {
            "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
        }  # fmt: skip
    finally:
        slapo.env.teardown()
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    assert "MASTER_PORT" not in os.environ
    assert os.environ["LOCAL_RANK"] == "0" and os.environ["MASTER_ADDR"] == "127.0.0.1"
    with pytest.raises(SlapoError, match="slapo.env.setup"):
        slapo.env.export_env()


def test_deepspeed_needs_a_process_group():
    sch = slapo.create_schedule(hf_models.make("gpt2"))
    with pytest.raises(TargetError, match="slapo.env.setup"):
        slapo.build(sch, target="deepspeed")


def test_slapo_train_names_what_it_does_not_wire_for_deepspeed():
    from slapo.train import TrainConfig, train

    cfg = TrainConfig(target="deepspeed", pp=2, steps=1, batch_size=2, seq_len=16)
    with pytest.raises(SlapoError, match="--pp 2 with --target deepspeed is not wired"):
        train(cfg)
