"""Fixtures: a tiny training script with known outcomes and a tuning config for it."""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

TRIAL_SCRIPT = """
import argparse, json, sys, time
p = argparse.ArgumentParser()
p.add_argument("--log", required=True)
p.add_argument("--batch-size", type=int, required=True)
p.add_argument("--ckpt", choices=["True", "False"], required=True)
a = p.parse_args()
with open(a.log, "a") as f:  # one line per run: tests count how often each config ran
    f.write(json.dumps({"batch_size": a.batch_size, "ckpt": a.ckpt == "True"}) + "\\n")
if a.batch_size == 3:
    sys.exit("boom: bad batch size")
if a.batch_size == 5:
    time.sleep(60)
if a.batch_size == 64 and a.ckpt == "False":
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB", file=sys.stderr)
    sys.exit(1)
print("step 1 loss 2.3")
print(json.dumps({"throughput": a.batch_size * (0.8 if a.ckpt == "True" else 1.0), "mem": 1}))
print("done")
"""

TUNE_CFG = """
def update_space(args, space):
    assert args.log.endswith("runs.log")  # the training command's flags reach the config
    space.create_symbol("batch_size", [3, 5, 8, 16, 64])
    space.create_symbol("ckpt", [True, False])
    return space
"""


@dataclass
class Project:
    """Paths of a throwaway tuning project."""

    root: Path
    script: Path
    config: Path
    db: Path
    log: Path

    @property
    def command(self) -> list[str]:
        return [sys.executable, str(self.script), "--log", str(self.log)]

    def runs(self) -> list[dict]:
        """Every configuration the training script was started with, in order."""
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def project(tmp_path: Path) -> Project:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRIAL_SCRIPT))
    config = tmp_path / "tune_cfg.py"
    config.write_text(textwrap.dedent(TUNE_CFG))
    return Project(tmp_path, script, config, tmp_path / "results.json", tmp_path / "runs.log")
