"""``import slapo`` stays light: the test harnesses of :mod:`slapo.testing` (the model zoo and
its checks) are never imported by the library, only by tests and benchmarks."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _modules_after(statement: str) -> set[str]:
    """The names in ``sys.modules`` after ``statement`` runs in a fresh interpreter."""
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


@pytest.mark.parametrize(
    "statement", ["import slapo", "import slapo.train, slapo.tune, slapo.plan, slapo.cli"]
)
def test_library_does_not_import_testing(statement: str) -> None:
    loaded = _modules_after(statement)
    assert "slapo" in loaded
    harness = sorted(m for m in loaded if m == "slapo.testing" or m.startswith("slapo.testing."))
    assert harness == [], f"{statement!r} imported the test harness: {harness}"


def test_testing_is_importable_on_demand() -> None:
    # the check above must be able to fail: importing the harness does load it
    assert "slapo.testing.zoo_checks" in _modules_after("import slapo.testing")
