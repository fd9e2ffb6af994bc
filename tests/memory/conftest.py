"""Shared setup of the memory-planner tests: their spawned jobs import by name; eager fused kernels.

``torch.compile`` of the fused kernels costs seconds per shape on CPU, and the fake step of the
estimator runs compiled code uncompiled anyway: the real steps measured here run them eagerly too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


@pytest.fixture(autouse=True)
def _eager_fused_kernels(monkeypatch):
    from slapo.model_schedule import fusion

    monkeypatch.setattr(fusion, "COMPILER", None)
