"""``slapo train`` estimates each run before its first step and prints the estimate beside the
peak it then measures (on CPU: parameter, buffer, gradient and optimizer bytes plus the most
bytes saved for backward in a step)."""

from __future__ import annotations

import pytest

from slapo.train import TrainConfig, format_summary, train


def _row(summary: dict) -> str:
    return next(line for line in format_summary(summary).splitlines() if "estimated peak" in line)


def test_train_prints_the_estimate_beside_the_measured_peak():
    # uncompiled: the estimate runs the schedule's eager code (a compiled region saves what
    # inductor's partitioner picks, which it does not model)
    cfg = {"baseline_steps": 0, "sample": False, "compile_model": False}
    out = train(TrainConfig(model="bert", steps=2, batch_size=4, seq_len=64, progress=False, **cfg))
    est, measured = out["estimated_peak_mb"], out["peak_memory_mb"]
    assert abs(est - measured) <= 0.10 * measured, (est, measured)
    assert out["estimate"]["optimizer"] == "AdamW"
    assert out["estimate"]["peak"] == pytest.approx(est * 2**20)  # on CPU, the peak's definition
    assert f"{est:,.1f} (" in _row(out) and "%)" in _row(out)
    # a run the estimator does not model (another target) says so
    assert _row({**out, "estimated_peak_mb": None, "estimate": None}).split()[-1] == "n/a"
