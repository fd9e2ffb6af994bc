"""Shared fixtures: one spawned job per world size runs every distributed check of the suite.

Spawning gloo workers costs seconds per process (importing torch and transformers), so the DP and
pipeline checks share one 2-rank and one 4-rank job; each test reports one check of a job.
"""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# tests/sharding's tensor-parallel plans and expert jobs; tests/roundpipe's helpers
for extra in (HERE, HERE.parent / "sharding", HERE.parent / "roundpipe"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

# A gloo group's timeout: a rank blocked past it would raise a timeout, not the stage's error.
PG_TIMEOUT = 120.0


@pytest.fixture(scope="session")
def ranks2():
    import target_jobs as jobs

    from dist_utils import check_all, run_workers

    return check_all(
        run_workers(jobs.job2, 2, args=(PG_TIMEOUT,), timeout=PG_TIMEOUT, deadline=200)
    )


@pytest.fixture(scope="session")
def ranks4():
    import target_jobs as jobs

    from dist_utils import check_all, run_workers

    return check_all(
        run_workers(jobs.job4, 4, args=(PG_TIMEOUT,), timeout=PG_TIMEOUT, deadline=200)
    )


@pytest.fixture(scope="session")
def ranks8():
    import target_jobs as jobs

    from dist_utils import check_all, run_workers

    return check_all(
        run_workers(jobs.job8, 8, args=(PG_TIMEOUT,), timeout=PG_TIMEOUT, deadline=300)
    )
