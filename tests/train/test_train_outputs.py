"""`slapo train --output-dir`: the metrics always land; the loss plot never costs the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slapo.train import TrainConfig, train, write_outputs

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = {
    "steps": 2, "batch_size": 2, "seq_len": 16, "progress": False,
    "baseline_steps": 0, "sample": False, "compile_model": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def summary() -> dict:
    return train(TrainConfig(**SMALL))


def test_metrics_then_a_png_plot(tmp_path, summary):
    plot = write_outputs(tmp_path, summary, [{**summary, "label": "scheduled"}])
    assert plot == tmp_path / "loss.png" and plot.read_bytes()[:8] == PNG
    assert json.loads((tmp_path / "metrics.json").read_text())["losses"] == summary["losses"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "metrics.json"]


def test_a_plot_that_cannot_be_saved_keeps_the_metrics_and_says_so(tmp_path, summary, capsys):
    (tmp_path / "loss.png").mkdir()  # a directory where the PNG should go: savefig fails
    assert write_outputs(tmp_path, summary, [{**summary, "label": "scheduled"}]) is None
    assert json.loads((tmp_path / "metrics.json").read_text())["losses"] == summary["losses"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "skipped" in err[0] and "metrics.json" in err[0]


@pytest.mark.slow
def test_cli_without_matplotlib_writes_metrics_prints_the_summary_and_exits_0(tmp_path: Path):
    # `None` in sys.modules makes `import matplotlib` raise ImportError, as if not installed.
    argv = ["slapo", "train", "--no-progress", "--output-dir", str(tmp_path), "--json"]
    argv += ["--steps", "2", "--batch-size", "2", "--seq-len", "16"]
    code = (
        "import runpy, sys\n"
        "sys.modules['matplotlib'] = None\n"
        f"sys.argv = {argv!r}\n"
        "runpy.run_module('slapo', run_name='__main__', alter_sys=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert len(metrics["losses"]) == 2
    assert not (tmp_path / "loss.png").exists()
    notes = [line for line in out.stderr.splitlines() if "matplotlib" in line]
    assert len(notes) == 1 and "pip install matplotlib" in notes[0] and "skipped" in notes[0]
    assert "tokens/s" in out.stdout  # the printed summary survived
    assert json.loads(out.stdout.strip().splitlines()[-1])["throughput"] == metrics["tokens_per_s"]
