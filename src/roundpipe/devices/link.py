"""Copy engines of RoundPipe devices, and the link model that makes CPU copies take time.

A GPU moves data with DMA engines that run beside its compute units. A device here gets the
same shape: one :class:`CopyEngine` per direction (host -> device, device -> host), to which the
device's worker queues transfers and from which it gets back :class:`CopyEvent` objects, real
events that complete when the transfer did and that a thread can wait on.

**Link model** (CPU virtual devices): with ``ROUNDPIPE_VIRTUAL_LINK_GBPS=<float>`` (gigabytes,
1e9 bytes, per second) every transfer occupies its engine for at least ``nbytes / bandwidth``
seconds of wall time. The engine is a thread that sleeps for whatever part of that time the copy
itself did not take, so a modelled transfer costs no compute core, and copies really overlap the
compute of the device's worker thread on a machine with few cores. Without the variable, CPU
engines run each copy inline in the calling thread, at no extra cost.

**Lanes.** An engine serves two lanes, the way two CUDA streams share one DMA engine: ``express``
(activations: small and on the critical path) and ``bulk`` (parameters and gradients, large,
prefetched or drained in the background). Transfers on one lane complete in submission order, as
work on one stream does. The engine serves express work first and pauses a bulk transfer to let
express work through (the GPU analogue is a large upload split into chunks, with activation copies
issued between them); the paused transfer resumes where it stopped, so every byte still costs its
full link time.

**Holding the link.** A transfer its caller waits for anyway (an activation the next layer needs,
a stage uploaded when it starts) need not cross to the engine thread and back: with
:meth:`CopyLane.hold` the calling thread occupies the link itself for the transfer's time, and
a bulk transfer in flight on the engine pauses meanwhile, exactly as for express work. That keeps
two thread switches per copy off the critical path.

Example:
    >>> eng = CopyEngine("demo h2d", gbps=0.001, threaded=True)  # 1 MB/s
    >>> ev = eng.bulk.submit("upload", "layer 0", 2000)  # 2 ms on the link
    >>> ev.query()  # submitted, not yet complete (the engine thread sleeps on it)
    False
    >>> ev.synchronize(); ev.query(), ev.end - ev.start >= 0.002
    (True, True)
    >>> eng.shutdown()
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from ..errors import RoundPipeRuntimeError, RoundPipeValueError
from .threads import RoundPipeThread, RoundPipeTimeoutError, get_wait_timeout

__all__ = [
    "LINK_ENV",
    "TRACE_LIMIT",
    "CopyEngine",
    "CopyEvent",
    "CopyLane",
    "TraceRecord",
    "link_gbps_from_env",
]

LINK_ENV = "ROUNDPIPE_VIRTUAL_LINK_GBPS"
# most records a device's trace keeps (a ring buffer: the newest survive)
TRACE_LIMIT = 4096


_timing = threading.local()


def _precise_sleeps() -> None:
    """Let this thread's sleeps end on time: Linux delays every timed wait by up to the
    thread's timer slack (50 us by default), which would add to each modelled transfer. Best
    effort, once per thread; elsewhere a no-op."""
    if getattr(_timing, "done", False):
        return
    _timing.done = True
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK: 1 ns
        except (OSError, AttributeError):
            pass


class TraceRecord(NamedTuple):
    """One span of device activity, in ``time.perf_counter()`` seconds.

    ``kind`` is ``"upload"`` (stage parameters, host -> device), ``"download"`` (stage
    gradients), ``"h2d"`` / ``"d2h"`` (activations) or ``"compute"`` (a stage's compute on the
    worker thread); ``what`` names the stage (``"<model> backward layers 2-3"``); ``nbytes``
    is what a transfer moved (0 for compute).
    """

    kind: str
    what: str
    start: float
    end: float
    nbytes: int = 0


def link_gbps_from_env() -> float | None:
    """The modelled link bandwidth in GB/s from ``ROUNDPIPE_VIRTUAL_LINK_GBPS`` (None if unset).

    Example:
        >>> os.environ.pop(LINK_ENV, None) and None
        >>> link_gbps_from_env() is None
        True
    """
    raw = os.environ.get(LINK_ENV, "").strip()
    if not raw:
        return None
    return check_gbps(raw, LINK_ENV)


def check_gbps(value: Any, name: str) -> float:
    """``value`` as a positive, finite bandwidth in GB/s, or a ValueError naming ``name``."""
    try:
        gbps = float(value)
    except (TypeError, ValueError):
        gbps = float("nan")
    if not (0 < gbps < float("inf")):
        raise RoundPipeValueError(
            f"{name} must be a positive number of gigabytes per second (e.g. 16), got {value!r}"
        )
    return gbps


class CopyEvent:
    """Completion of one transfer (or a marker on a lane): a real, waitable event.

    Created complete (like an unrecorded CUDA event) unless a lane hands it out for queued work.
    ``start`` / ``end`` are the ``perf_counter`` times the engine began and finished it.

    Example:
        >>> CopyEvent().query()
        True
    """

    __slots__ = ("kind", "what", "nbytes", "start", "end", "error", "_done")

    def __init__(self, kind: str = "", what: str = "", nbytes: int = 0, done: bool = True) -> None:
        self.kind = kind
        self.what = what
        self.nbytes = nbytes
        self.start = 0.0
        self.end = 0.0
        self.error: BaseException | None = None
        self._done = threading.Event()
        if done:
            self._done.set()

    def __repr__(self) -> str:
        state = "done" if self.query() else "pending"
        return f"CopyEvent({self.kind} {self.what!r}, {self.nbytes} bytes, {state})"

    def query(self) -> bool:
        """Whether the transfer completed."""
        return self._done.is_set()

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until complete (at most ``timeout`` s, default the RoundPipe wait deadline);
        re-raise the transfer's error, if it had one."""
        limit = get_wait_timeout() if timeout is None else timeout
        if not self._done.wait(limit):
            raise RoundPipeTimeoutError(
                f"RoundPipe timed out after {limit:.0f} s waiting for {self.kind} of {self.what}"
            )
        if self.error is not None:
            raise self.error

    def wait(self, stream: Any = None) -> None:
        """CUDA-event spelling: make the caller's work (here: the calling thread) wait."""
        self.synchronize()

    def record(self, stream: Any = None) -> None:
        """Complete once all work queued so far on ``stream`` (a :class:`CopyLane`) completed;
        on anything else (a synchronous compute "stream") the event completes at once."""
        if isinstance(stream, CopyLane):
            self._done.clear()
            stream.submit("marker", "record", 0, then=lambda: None, event=self)
        else:
            self._done.set()

    def _finish(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()


class _Item:
    __slots__ = ("event", "fn", "then")

    def __init__(
        self, event: CopyEvent, fn: Callable[[], Any] | None, then: Callable[[], Any] | None
    ) -> None:
        self.event = event
        self.fn = fn
        self.then = then


class CopyLane:
    """One lane of a :class:`CopyEngine`: transfers on it complete in submission order."""

    def __init__(self, engine: CopyEngine, express: bool) -> None:
        self.engine = engine
        self.express = express
        self.name = f"{engine.name} {'express' if express else 'bulk'}"
        self._last: CopyEvent | None = None

    def __repr__(self) -> str:
        return f"CopyLane({self.name})"

    def submit(
        self,
        kind: str,
        what: str,
        nbytes: int,
        fn: Callable[[], Any] | None = None,
        then: Callable[[], Any] | None = None,
        event: CopyEvent | None = None,
    ) -> CopyEvent:
        """Queue a transfer of ``nbytes``: the engine runs ``fn`` (the copy itself, if any),
        holds the link for the rest of ``nbytes / bandwidth``, then runs ``then`` (e.g. hand the
        arrived data over) and completes the returned event. An exception in ``fn`` / ``then``
        is kept on the event and re-raised by :meth:`CopyEvent.synchronize`."""
        return self.engine._submit(self, kind, what, nbytes, fn, then, event)

    def hold(self, kind: str, what: str, nbytes: int, fn: Callable[[], Any] | None = None) -> None:
        """Run ``fn`` (the copy, if any) in the calling thread and keep the link for the rest
        of ``nbytes / bandwidth``, pausing bulk work on the engine meanwhile; return when the
        transfer is complete. Without a modelled link this just runs ``fn``."""
        self.engine._hold(kind, what, nbytes, fn)

    def record_event(self) -> CopyEvent:
        """An event that completes once everything queued so far on this lane completed."""
        ev = CopyEvent("marker", self.name, 0, done=False)
        ev.record(self)
        return ev

    def synchronize(self) -> None:
        """Block until everything queued so far on this lane completed."""
        self.record_event().synchronize()

    def query(self) -> bool:
        """Whether everything queued on this lane completed."""
        last = self._last
        return last is None or last.query()

    # stream spellings used by code shared with CUDA streams: ordering between lanes and the
    # synchronous compute "stream" is by events the worker waits on, so these have no effect
    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


class CopyEngine:
    """One direction of a device's link: transfers run in order on their lane, optionally at
    the modelled bandwidth, on the engine's own thread (``threaded``) or inline.

    ``trace`` (a bounded deque, if given) receives a :class:`TraceRecord` per transfer run on
    the engine thread.
    """

    def __init__(
        self,
        name: str,
        gbps: float | None = None,
        threaded: bool = False,
        trace: collections.deque | None = None,
    ) -> None:
        if gbps is not None:
            gbps = check_gbps(gbps, "gbps")
            if not threaded:
                raise RoundPipeValueError("a modelled link needs a threaded copy engine")
        self.name = name
        self.gbps = gbps
        self.bandwidth = gbps * 1e9 if gbps is not None else None
        self.threaded = threaded
        self.trace = trace
        self.express = CopyLane(self, express=True)
        self.bulk = CopyLane(self, express=False)
        self._queues: dict[bool, collections.deque[_Item]] = {
            True: collections.deque(),
            False: collections.deque(),
        }
        self._cv = threading.Condition()
        self._outstanding = 0
        self._stop = False
        self._holders = 0  # callers holding the link (CopyLane.hold): bulk work pauses
        self._hold_lock = threading.Lock()  # the link carries one held transfer at a time
        self.thread: RoundPipeThread | None = None
        if threaded:
            self.thread = RoundPipeThread(self._loop, name=f"roundpipe-{name}")
            self.thread.start()

    def __repr__(self) -> str:
        link = f"{self.gbps} GB/s" if self.gbps is not None else "no link model"
        return f"CopyEngine({self.name}, {link}, {'threaded' if self.threaded else 'inline'})"

    # -- submission -------------------------------------------------------------------------
    def _submit(
        self,
        lane: CopyLane,
        kind: str,
        what: str,
        nbytes: int,
        fn: Callable[[], Any] | None,
        then: Callable[[], Any] | None,
        event: CopyEvent | None,
    ) -> CopyEvent:
        if event is None:
            event = CopyEvent(kind, what, nbytes, done=False)
        item = _Item(event, fn, then)
        if not self.threaded:
            self._run(item, preemptible=False)
            return event
        with self._cv:
            if self._stop:
                raise RoundPipeRuntimeError(f"{self} has been shut down")
            self._queues[lane.express].append(item)
            self._outstanding += 1
            lane._last = event
            self._cv.notify_all()
        return event

    # -- the engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        _precise_sleeps()
        while True:
            with self._cv:
                while not (self._queues[True] or self._queues[False] or self._stop):
                    self._cv.wait()
                if self._queues[True]:
                    item, preemptible = self._queues[True].popleft(), False
                elif self._queues[False]:
                    item, preemptible = self._queues[False].popleft(), True
                else:
                    return  # stopped, nothing left
            self._run(item, preemptible)

    def _run(self, item: _Item, preemptible: bool) -> None:
        ev = item.event
        error: BaseException | None = None
        ev.start = time.perf_counter()
        try:
            if item.fn is not None:
                item.fn()
            if self.bandwidth is not None and ev.nbytes:
                self._hold_link(ev, preemptible)
        except BaseException as exc:  # noqa: BLE001 - kept on the event for its waiter
            error = exc
        ev.end = time.perf_counter()
        if self.trace is not None and self.threaded and ev.kind != "marker":
            self.trace.append(TraceRecord(ev.kind, ev.what, ev.start, ev.end, ev.nbytes))
        if item.then is not None and error is None:
            try:
                item.then()  # the transfer arrived: hand it over
            except BaseException as exc:  # noqa: BLE001
                error = exc
        item.fn = item.then = None  # drop the callbacks' references before signalling
        ev._finish(error)
        if self.threaded:
            with self._cv:
                self._outstanding -= 1
                self._cv.notify_all()

    def _hold_link(self, ev: CopyEvent, preemptible: bool) -> None:
        """Keep the link busy until ``ev`` had ``nbytes / bandwidth`` seconds of it; express work
        and callers holding the link meanwhile go first and do not count toward its time."""
        assert self.bandwidth is not None
        end = ev.start + ev.nbytes / self.bandwidth
        while True:
            urgent = None
            with self._cv:
                if preemptible and self._holders:
                    paused = time.perf_counter()
                    while self._holders:
                        self._cv.wait(0.05)  # a holder releases in nbytes / bandwidth
                    end += time.perf_counter() - paused
                    continue
                if preemptible and self._queues[True]:
                    urgent = self._queues[True].popleft()
                else:
                    now = time.perf_counter()
                    if now >= end:
                        return
                    self._cv.wait(end - now)  # a submission or a holder wakes us
                    continue
            paused = time.perf_counter()
            self._run(urgent, preemptible=False)
            end += time.perf_counter() - paused

    def _hold(self, kind: str, what: str, nbytes: int, fn: Callable[[], Any] | None) -> None:
        if self.bandwidth is None or not nbytes:
            if fn is not None:
                fn()
            return
        _precise_sleeps()
        with self._hold_lock:
            with self._cv:
                self._holders += 1
                self._cv.notify_all()
            start = time.perf_counter()
            try:
                if fn is not None:
                    fn()
                left = start + nbytes / self.bandwidth - time.perf_counter()
                if left > 0:
                    time.sleep(left)
            finally:
                end = time.perf_counter()
                with self._cv:
                    self._holders -= 1
                    self._cv.notify_all()
        if self.trace is not None:
            self.trace.append(TraceRecord(kind, what, start, end, nbytes))

    # -- waiting / shutdown -----------------------------------------------------------------
    def busy(self) -> bool:
        """Whether transfers are queued or running."""
        with self._cv:
            return self._outstanding > 0

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until every queued transfer completed (bounded by the wait deadline)."""
        if not self.threaded:
            return
        limit = get_wait_timeout() if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cv:
            while self._outstanding > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RoundPipeTimeoutError(
                        f"RoundPipe timed out after {limit:.0f} s waiting for {self.name} to drain"
                    )
                self._cv.wait(left)

    def shutdown(self) -> None:
        """Finish the queued transfers, then stop the engine thread."""
        if self.thread is None:
            return
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self.thread.join(timeout=get_wait_timeout())
