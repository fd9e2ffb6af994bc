"""Every tutorial in docs/tutorials runs to the end, and its own checks pass.

Each tutorial asserts what it teaches (the scheduled model's loss and gradients against the
unscheduled model's, with torch.testing.assert_close) and prints one "OK" line per process
when every check passed; a failed check exits non-zero. The distributed ones run under torchrun
(``python -m torch.distributed.run``) on gloo, on a free port, with a deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "docs" / "tutorials"
WORLD = {"03_tensor_parallel_mlp.py": 2, "05_pipeline_stages.py": 2}  # processes; others: 1
DEADLINE = 120  # seconds: far above each tutorial's time, below a hung collective's forever

pytestmark = pytest.mark.slow


def tutorials() -> list[str]:
    return sorted(p.name for p in TUTORIALS.glob("[0-9][0-9]_*.py"))


def run_tutorial(name: str) -> subprocess.CompletedProcess:
    world = WORLD.get(name, 1)
    script = str(TUTORIALS / name)
    if world == 1:
        cmd = [sys.executable, script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-port", str(free_port()), script]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE, cwd=ROOT, env=env)


def test_the_tutorials_are_numbered_and_linked_from_the_readme():
    names = tutorials()
    assert [n[:2] for n in names] == [f"{i:02d}" for i in range(1, 7)], names
    readme = (ROOT / "README.md").read_text()
    missing = [n for n in names if f"docs/tutorials/{n}" not in readme]
    assert not missing, f"README.md does not link {missing}"


@pytest.mark.parametrize("name", tutorials())
def test_tutorial_runs_and_its_checks_pass(name):
    done = run_tutorial(name)
    out = done.stdout
    assert done.returncode == 0, (
        f"{name} exited {done.returncode}:\n{out[-3000:]}\n{done.stderr[-4000:]}"
    )
    world = WORLD.get(name, 1)
    if world == 1:
        assert out.rstrip().splitlines()[-1].startswith("OK"), out[-2000:]
    else:  # every rank reports its own checks
        for rank in range(world):
            assert f"rank {rank}: OK" in out, out[-2000:]
