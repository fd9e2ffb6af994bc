"""Fail together: when one pipeline stage raises, every rank raises that stage's error.

The peers of a failing stage wait in a point-to-point receive (or a tensor-parallel collective)
that would otherwise block until the process group's timeout and then report only "timeout".
Instead, the failing rank writes its error to the rendezvous store, raises a failure flag there,
and breaks its links to every peer, which wakes those blocked on it. Every other rank runs a
watcher thread during the step that polls the flag every ``POLL_S`` seconds and, once it is up,
breaks its own links too: so ranks two or more hops away wake within a poll, not at the group's
timeout. Each rank then reads every report and raises the earliest one: the stage that failed
first.

Breaking a link: ``ProcessGroup.abort()`` does not wake a blocked gloo receive, but a gloo receive
that times out closes its connection ("pair") to that peer, failing every pending operation on
it at both ends. So a link is broken with a receive on an unused tag and a tiny timeout.
"""

from __future__ import annotations

import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..logger import get_logger
from .errors import PipelineError

__all__ = ["FailTogether"]

_PREFIX = "slapo/pipeline_error/"
_FLAG = _PREFIX + "flag"
POLL_S = 0.2
_BREAK_TAG = 0x5A1F  # a tag no pipeline message uses


class FailTogether:
    """Context of one pipeline step; ``timeout`` bounds the wait for the other ranks' reports."""

    def __init__(self, stages_of_rank: dict[int, list[int]], timeout: float) -> None:
        # Kept from the start: the store still works once the group's links are broken.
        self.store = c10d._get_default_store()
        self.stages_of_rank = stages_of_rank
        self.timeout = timeout
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._broken = False
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> FailTogether:
        self._done.clear()
        self._watcher = threading.Thread(target=self._watch, name="slapo-fail-watch", daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> bool:
        self._done.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5 * POLL_S)
            self._watcher = None
        if exc is None or not isinstance(exc, Exception):
            return False
        raise self._fail(exc) from exc

    def _watch(self) -> None:
        """Break this rank's links as soon as another rank raises the failure flag."""
        while not self._done.wait(POLL_S):
            try:
                if self.store.check([_FLAG]):
                    self._break_links()
                    return
            except Exception:  # noqa: BLE001  (the store's host is gone: the step fails anyway)
                return

    def _break_links(self) -> None:
        """Fail every pending operation with every peer, here and at the peer (see above)."""
        with self._lock:
            if self._broken:
                return
            self._broken = True
        for pg in list(c10d._world.pg_map):
            try:
                ranks = dist.get_process_group_ranks(pg)
            except Exception:  # noqa: BLE001  (a group already destroyed)
                continue
            for peer in ranks:
                if peer != self.rank:
                    self._break_link(pg, peer)

    @staticmethod
    def _break_link(pg: dist.ProcessGroup, peer: int) -> None:
        try:
            if "gloo" not in str(dist.get_backend(pg)):
                pg.abort()  # NCCL and others do wake their waiters on abort
                return
            work = dist.irecv(torch.zeros(1), src=peer, group=pg, tag=_BREAK_TAG)
            work.wait(timedelta(milliseconds=20))
        except Exception as exc:  # noqa: BLE001  (the expected way this ends)
            get_logger().debug("broke the link to rank %d: %s", peer, exc)

    def _fail(self, exc: Exception) -> PipelineError:
        stages = self.stages_of_rank.get(self.rank, [])
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            self.store.set(f"{_PREFIX}{self.rank}", f"{time.time():.6f}|{stages}|{text}")
            self.store.set(_FLAG, "1")  # wakes the others' watchers
        except Exception as store_exc:  # noqa: BLE001  (the store's host may be gone)
            get_logger().debug("reporting a pipeline failure: %s", store_exc)
        self._break_links()  # wakes the peers blocked on this rank
        reports = self._collect()
        self._leave()
        first_rank, (_, first_stages, first_text) = min(reports.items(), key=lambda kv: kv[1][0])
        where = (
            f"stage {', '.join(first_stages)} (rank {first_rank})"
            if first_stages
            else (f"rank {first_rank}")
        )
        missing = sorted(set(range(self.world)) - set(reports))
        note = f"; no report from ranks {missing}" if missing else ""
        return PipelineError(f"pipeline step failed on {where}: {first_text}{note}")

    def _leave(self) -> None:
        # The store lives in rank 0's process: rank 0 waits (briefly) until every rank has read.
        try:
            self.store.add(f"{_PREFIX}done", 1)
            end = time.monotonic() + min(self.timeout, 10.0)
            while self.rank == 0 and time.monotonic() < end:
                if self.store.add(f"{_PREFIX}done", 0) >= self.world:
                    break
                time.sleep(0.05)
        except Exception:  # noqa: BLE001  (the store's host may be gone)
            pass

    def _collect(self) -> dict[int, tuple[float, list[str], str]]:
        keys = [f"{_PREFIX}{r}" for r in range(self.world)]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except Exception:  # noqa: BLE001  (a rank that never reports: use what arrived)
            pass
        reports = {}
        for r, key in enumerate(keys):
            try:
                if not self.store.check([key]):
                    continue
                stamp, stages, text = self.store.get(key).decode().split("|", 2)
            except Exception:  # noqa: BLE001  (the store's host may be gone)
                continue
            names = [s for s in stages.strip("[]").split(", ") if s]
            reports[r] = (float(stamp), names, text)
        if not reports:
            reports[self.rank] = (0.0, [], "unknown error")
        return reports
