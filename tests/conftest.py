"""Test-wide setup: shared helper modules (tests/dist_utils.py, tests/core/hf_models.py) import by name."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _extra in (_TESTS, _TESTS / "core"):
    if str(_extra) not in sys.path:
        sys.path.insert(0, str(_extra))
