"""The rank-aware logger (``get_logger().info(msg, ranks=0)``) and ``sch.rank`` /
``sch.world_size``, in one process and on two gloo ranks."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist
from torch import nn

import slapo
from dist_utils import check_all, run_workers
from slapo.logger import get_logger


class Said(logging.Handler):
    """Collects what a logger says, with the function that said it."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def said_by(logger: logging.Logger, say) -> list[logging.LogRecord]:
    handler = Said()
    logger.addHandler(handler)
    try:
        say(logger)
    finally:
        logger.removeHandler(handler)
    return handler.records


def speak(logger) -> None:
    """What Slapo code logs: to rank 0, to ranks 0 and 1, to rank 1, and to every rank."""
    logger.info("rank 0 only", ranks=0)
    logger.info("ranks 0 and 1", ranks=[0, 1])
    logger.warning("rank 1 only", ranks=1)
    logger.info("everyone %d", 7)


def test_the_logger_logs_on_the_ranks_asked_for_rank_0_without_distributed():
    records = said_by(slapo.get_logger(), speak)
    assert [r.getMessage() for r in records] == ["rank 0 only", "ranks 0 and 1", "everyone 7"]
    assert {r.funcName for r in records} == {"speak"}  # the caller, not the logger's frames


def test_every_logging_method_takes_ranks():
    def say(logger):
        logger.debug("hidden at INFO", ranks=0)
        logger.error("error", ranks=(0,))
        logger.log(logging.WARNING, "log", ranks=[0])
        logger.critical("not mine", ranks=[3])
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("exception", ranks=0)

    records = said_by(get_logger(), say)
    assert [r.getMessage() for r in records] == ["error", "log", "exception"]
    assert records[-1].exc_info is not None


def test_a_logger_made_before_slapo_asks_keeps_its_handlers():
    plain = logging.getLogger("slapo-compat-test")
    handler = Said()
    plain.addHandler(handler)
    try:
        logger = get_logger("slapo-compat-test")
        assert logger is plain and logger.handlers == [handler]
        logger.info("shown", ranks=0)
        logger.info("not shown", ranks=1)
        assert [r.getMessage() for r in handler.records] == ["shown"]
    finally:
        plain.removeHandler(handler)


def test_schedule_rank_and_world_size_without_distributed():
    sch = slapo.create_schedule(nn.Sequential(nn.Linear(2, 2)))
    assert (sch.rank, sch.world_size) == (0, 1)
    assert (sch["0"].rank, sch["0"].world_size) == (0, 1)


def _ranks_job(rank: int, world: int) -> dict:
    """On each rank: what the logger let through, and the ranks and sizes schedules report."""
    from torch.distributed.device_mesh import init_device_mesh

    model = nn.Sequential(nn.Linear(2, 2))
    singles = [dist.new_group([r]) for r in range(world)]  # every rank takes part in new_group
    schedules = {
        "world": slapo.create_schedule(model),
        "own": slapo.create_schedule(model, group=singles[rank]),
        "mesh": slapo.create_schedule(model, group=init_device_mesh("cpu", (world,))),
    }
    return {
        "said": [r.getMessage() for r in said_by(get_logger(), speak)],
        **{k: (s.rank, s.world_size, s["0"].rank) for k, s in schedules.items()},
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_logger_ranks_and_schedule_rank_on_two_gloo_ranks():
    reports = check_all(run_workers(_ranks_job, world=2, timeout=60, deadline=180))
    assert reports[0]["said"] == ["rank 0 only", "ranks 0 and 1", "everyone 7"]
    assert reports[1]["said"] == ["ranks 0 and 1", "rank 1 only", "everyone 7"]
    for rank, report in enumerate(reports):
        assert report["world"] == (rank, 2, rank)
        assert report["own"] == (0, 1, 0)  # a one-rank group: rank 0 of 1 in it
        assert report["mesh"] == (rank, 2, rank)
