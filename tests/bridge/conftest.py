"""The RoundPipe test helpers (tests/roundpipe/helpers.py) import by name here too."""

from __future__ import annotations

import sys
from pathlib import Path

_ROUNDPIPE_TESTS = str(Path(__file__).resolve().parent.parent / "roundpipe")
if _ROUNDPIPE_TESTS not in sys.path:
    sys.path.insert(0, _ROUNDPIPE_TESTS)
