import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for extra in (HERE, HERE.parent / "core"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))
