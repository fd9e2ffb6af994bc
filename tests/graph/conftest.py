"""Setup of the static-graph tests; their shared models live in ``graph_models``."""

from __future__ import annotations

import sys
from pathlib import Path

# The small transformers models and the equivalence oracle live with the core tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
