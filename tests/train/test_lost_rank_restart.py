"""A run that survives a lost rank: ``torchrun --max-restarts 1 ... --save DIR --save-every K
--resume DIR`` is one command for the first start and the restart. One worker is killed
(SIGKILL) once the first step checkpoint is complete; torchrun restarts the group, every rank
resumes from the latest complete step checkpoint, and the run ends with the loss curve of the
same command left alone (exactly: resuming restores every bit of the state, and both runs
launch the same way)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_utils import free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS, EVERY = 40, 4
DEADLINE = 240  # seconds for one torchrun: far above a run's time, below a hang's forever


def command(tmp_path: Path, name: str) -> list[str]:
    ckpt = str(tmp_path / f"{name}-ckpt")
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "1", "--master-port", str(free_port()),
        "-m", "slapo", "train", "--steps", str(STEPS), "--batch-size", "2", "--seq-len", "32",
        "--baseline-steps", "0", "--no-progress", "--no-sample", "--compile-model", "false",
        "--save", ckpt, "--save-every", str(EVERY), "--resume", ckpt,
        "--output-dir", str(tmp_path / name),
    ]  # fmt: skip


def workers_of(pid: int) -> list[int]:
    """The processes ``pid`` started (torchrun's workers), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{pid}\n" in status:
                found.append(int(entry.name))
    return sorted(found)


def metrics(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / name / "metrics.json").read_text())


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers in /proc")
def test_a_killed_rank_restarts_and_ends_with_the_uninterrupted_losses(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    left_alone = subprocess.run(
        command(tmp_path, "whole"), capture_output=True, text=True, timeout=DEADLINE, env=env
    )
    assert left_alone.returncode == 0, left_alone.stderr[-3000:]
    assert "no checkpoint there yet; starting from step 0" in left_alone.stderr

    log = tmp_path / "killed.log"  # a file, not a pipe: nobody reads a pipe while we poll
    with log.open("w") as sink:
        run = subprocess.Popen(
            command(tmp_path, "killed"), stdout=sink, stderr=subprocess.STDOUT, env=env
        )
    first_step = tmp_path / "killed-ckpt" / f"step-{EVERY:06d}" / "train_state.json"
    deadline = time.monotonic() + DEADLINE
    killed = None
    try:
        while killed is None and run.poll() is None and time.monotonic() < deadline:
            workers = workers_of(run.pid)
            if first_step.is_file() and len(workers) == 2:
                killed = workers[-1]
                os.kill(killed, signal.SIGKILL)  # a lost rank, mid-run
            time.sleep(0.005)
        run.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if run.poll() is None:
            run.kill()
    err = log.read_text()
    assert killed is not None, f"the run ended before a rank could be killed:\n{err[-2000:]}"
    assert run.returncode == 0, err[-3000:]
    record = metrics(tmp_path, "killed")
    assert record["resumed_at"] is not None and EVERY <= record["resumed_at"] < STEPS, record
    assert record["losses"] == metrics(tmp_path, "whole")["losses"]
