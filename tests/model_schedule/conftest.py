"""Shared setup: the spawned jobs here import by name; eager fused kernels.

``torch.compile`` of the fused kernels costs seconds per shape on CPU; the numerics checked here
are those of the fused modules, so they run uncompiled (one test compiles them on purpose).
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
