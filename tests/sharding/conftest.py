"""The sharding tests' spawned jobs (and the tests/targets jobs reusing ``plans``, ``ep_jobs``)
import by name."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
