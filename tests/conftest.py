"""Test-wide setup: shared helper modules (tests/dist_utils.py, tests/hf_models.py,
tests/graph_models.py, ...) import by name; ``SLAPO_TEST_THREADS=N`` runs the session (and the
processes it starts) on N CPU threads.

No test may depend on the thread count: reductions split across threads sum in another order,
so bit-identity is claimed only where both sides run the same kernels on the same operands. Run
the suite with ``SLAPO_TEST_THREADS=1`` and ``=2`` (or ``OMP_NUM_THREADS``) to check it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))


def pytest_configure(config: pytest.Config) -> None:
    threads = os.environ.get("SLAPO_TEST_THREADS", "").strip()
    if not threads:
        return
    if not threads.isdigit() or int(threads) < 1:
        raise pytest.UsageError(f"SLAPO_TEST_THREADS must be a positive integer, got {threads!r}")
    import torch

    torch.set_num_threads(int(threads))
    os.environ["OMP_NUM_THREADS"] = threads  # the worker processes (torchrun, spawn) follow


def pytest_report_header(config: pytest.Config) -> str:
    import torch

    omp = os.environ.get("OMP_NUM_THREADS", "unset")
    return f"torch CPU threads: {torch.get_num_threads()} (OMP_NUM_THREADS={omp})"


@pytest.fixture(scope="session")
def launches(tmp_path_factory: pytest.TempPathFactory):
    """The suite's shared torchrun launches of ``slapo train``: one per world size, running every
    run the collected test modules planned for it (tests/shared_launches.py)."""
    from shared_launches import Launches

    return Launches(tmp_path_factory.mktemp("launches"))
