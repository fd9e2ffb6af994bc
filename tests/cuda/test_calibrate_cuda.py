"""On a GPU: a quick calibration against the H200 datasheet gives fractions of its peaks.

Skipped without CUDA (`scripts/gpu-check.sh` runs it on a GPU machine). No timing is asserted:
only that every measured rate became a fraction in (0, 1] and the datasheet figures stayed.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from slapo.plan import PRESETS, calibrate_device
from slapo.plan.hardware import OP_KINDS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_quick_calibration_against_the_h200_datasheet() -> None:
    base = PRESETS["h200"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # another GPU may outrun the H200's peaks
        spec = calibrate_device("cuda", base=base, quick=True)
    assert spec.peak_tflops == base.peak_tflops and spec.hbm_gbps == base.hbm_gbps
    assert set(spec.efficiency) == set(OP_KINDS)
    assert all(0 < v <= 1 for v in spec.efficiency.values())
    assert spec.intra_node.gbps == base.intra_node.gbps
    assert torch.cuda.get_device_name() in spec.source
    assert f"torch {torch.__version__}" in spec.source
