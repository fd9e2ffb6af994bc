"""Hugging Face ``Trainer`` trains the scheduled model (examples/hf_trainer.py) with the
unscheduled model's losses, with Trainer's defaults (``remove_unused_columns=True`` reads the
built model's forward signature), on one process and under torchrun with DDP on 2 gloo CPU
processes.

The model is the example's tiny GPT-2 without dropout (the recommended schedule compiles it and
draws dropout masks in bulk, other masks than eager's). Losses agree to float32 rounding:
the compiled model and its SDPA attention sum in another order than the eager model.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import free_port
from slapo.surgery import forward_wraps

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"
STEPS = 6
TOL = {"rtol": 1e-5, "atol": 1e-5}  # measured: about 1e-6 apart over the steps


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _close(scheduled: list[float], plain: list[float]) -> None:
    assert len(plain) == STEPS, plain  # every step logged
    torch.testing.assert_close(torch.tensor(scheduled), torch.tensor(plain), **TOL)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_trainer_one_process_gives_the_unscheduled_losses(tmp_path):
    example = _example()
    plain = example.train(use_slapo=False, steps=STEPS, output_dir=str(tmp_path))
    scheduled = example.train(use_slapo=True, steps=STEPS, output_dir=str(tmp_path))
    assert scheduled.args.remove_unused_columns  # Trainer's default, kept
    assert "compile" in forward_wraps(scheduled.model)  # the recommended schedule ran
    _close(example.logged_losses(scheduled), example.logged_losses(plain))


def _torchrun(tmp_path: Path, *flags: str) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(EXAMPLE), "--json", "--steps", str(STEPS),
           "--output-dir", str(tmp_path), *flags]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"losses"')]
    assert len(lines) == 1, done.stdout[-2000:]  # rank 0 prints them
    return json.loads(lines[0])["losses"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(330)
def test_trainer_under_torchrun_ddp_gives_the_unscheduled_losses(tmp_path):
    plain = _torchrun(tmp_path, "--no-slapo")
    _close(_torchrun(tmp_path), plain)
