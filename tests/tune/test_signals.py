"""A trial never outlives `slapo tune`: SIGTERM, Ctrl-C and SIGKILL of the tuner, real processes.

The trial command writes its own pid and the pid of a child it starts, then sleeps. After the
signal, both must be gone: the trial's whole process group dies with the tuner.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads process states from /proc"
)

# --fast 1 finishes at once with a result; --fast 0 starts a child and sleeps (both write pids).
SLEEPER = """
import argparse, json, os, subprocess, sys, time
p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--fast", type=int, required=True)
a = p.parse_args()
if a.fast:
    print(json.dumps({"throughput": 1.0}))
    sys.exit(0)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(os.path.join(a.dir, "pids.tmp"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.replace(os.path.join(a.dir, "pids.tmp"), os.path.join(a.dir, "pids"))
time.sleep(120)
"""

CONFIG = """
def update_space(args, space):
    space.create_symbol("fast", {fast})
    return space
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def _start_tuner(tmp_path: Path, fast: list[int]) -> tuple[subprocess.Popen[str], Path]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SLEEPER))
    config = tmp_path / "tune_cfg.py"
    config.write_text(textwrap.dedent(CONFIG.format(fast=fast)))
    db = tmp_path / "results.json"
    cmd = [
        sys.executable,
        "-m",
        "slapo.tune.tune_cli",
        "--config",
        str(config),
        "--db",
        str(db),
        "--no-progress",
        "--",
        sys.executable,
        str(script),
        "--dir",
        str(tmp_path),
    ]
    tuner = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (tmp_path / "pids").exists(), 120, "the trial to write its pid")
    except AssertionError:
        tuner.kill()
        out, err = tuner.communicate(timeout=30)
        raise AssertionError(f"the trial did not start:\n{out}\n{err}") from None
    return tuner, db


def _pids(tmp_path: Path) -> list[int]:
    return [int(p) for p in (tmp_path / "pids").read_text().split()]


def _kill_leftovers(*pids: int) -> None:
    """Never leave a sleeper behind, even when the test fails."""
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "fast"),
    [(signal.SIGTERM, [1, 0]), (signal.SIGTERM, [0]), (signal.SIGINT, [0])],
    ids=["sigterm-after-one-trial", "sigterm-during-first-trial", "sigint-during-first-trial"],
)
def test_signal_stops_the_trial_group_and_saves_the_database(tmp_path, sig, fast):
    tuner, db = _start_tuner(tmp_path, fast)
    trial, child = _pids(tmp_path)
    try:
        tuner.send_signal(sig)
        _, err = tuner.communicate(timeout=60)
        assert tuner.returncode == 128 + sig, err
        assert "interrupted" in err and signal.Signals(sig).name in err
        _wait_for(lambda: not _alive(trial) and not _alive(child), 10, "the trial group to die")
    finally:
        tuner.kill()
        tuner.wait(timeout=30)
        _kill_leftovers(trial, child)
    doc = json.loads(db.read_text())
    records = list(doc["records"].values())
    # The finished trial is kept; the interrupted one is not recorded, so a re-run measures it.
    assert [r["config"] for r in records] == ([{"fast": 1}] if 1 in fast else [])
    assert not list(tmp_path.glob(".results.json.*.tmp"))


@pytest.mark.slow
def test_sigkill_of_the_tuner_kills_the_trial_and_its_children(tmp_path):
    tuner, db = _start_tuner(tmp_path, [1, 0])
    trial, child = _pids(tmp_path)
    try:
        tuner.kill()
        tuner.wait(timeout=30)
        _wait_for(lambda: not _alive(trial), 10, "the trial to die")
        _wait_for(lambda: not _alive(child), 10, "the trial's child to die")
    finally:
        _kill_leftovers(trial, child)
    records = json.loads(db.read_text())["records"]
    assert [r["config"] for r in records.values()] == [{"fast": 1}]
