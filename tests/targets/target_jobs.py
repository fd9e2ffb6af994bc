"""The spawned jobs of the suite: every check of the 2-, 4- and 8-rank tests.

A check that makes a stage fail breaks the group's links, so it runs last.
"""

from __future__ import annotations

import jobs_dp
import jobs_lazy
import jobs_loop
import jobs_pp
import jobs_pp_ep
import jobs_precision

from dist_utils import run_checks


def job2(rank: int, world: int, pg_timeout: float) -> dict[str, str | None]:
    return run_checks(
        {
            **jobs_dp.dp_checks(rank, world),
            **jobs_loop.loop_checks(rank, world),
            **jobs_lazy.lazy_checks(rank, world),
            **jobs_precision.precision_checks(rank, world),
            **jobs_pp.pp2_checks(rank, world, pg_timeout),
        }
    )


def job4(rank: int, world: int, pg_timeout: float) -> dict[str, str | None]:
    return run_checks(
        {
            **jobs_dp.dp_tp_checks(rank, world),
            **jobs_pp_ep.pp_ep_checks(),
            **jobs_pp.pp4_checks(rank, world, pg_timeout),
        }
    )


def job8(rank: int, world: int, pg_timeout: float) -> dict[str, str | None]:
    return run_checks(jobs_pp.pp8_checks(rank, world, pg_timeout))
