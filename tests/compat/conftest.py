"""Setup of the Slapo-compatibility tests: they reuse the static-graph tests' models and oracle
(``tests/graph/graph_models.py``); tests/conftest.py already puts ``tests/core`` on the path."""

from __future__ import annotations

import sys
from pathlib import Path

_GRAPH = str(Path(__file__).resolve().parents[1] / "graph")
if _GRAPH not in sys.path:
    sys.path.insert(0, _GRAPH)
