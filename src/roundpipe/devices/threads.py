"""Thread helpers that keep RoundPipe worker threads observable and safe.

Every blocking wait in RoundPipe goes through :func:`wait_until` (or the annotated
primitives below): it polls in short slices so that a failing worker, an abort request or
a deadline (``ROUNDPIPE_WAIT_TIMEOUT`` seconds, default 300) ends the wait instead of
hanging the process.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from ..errors import RoundPipeError, RoundPipeValueError

__all__ = [
    "AnnotatedEvent",
    "AnnotatedSemaphore",
    "KeyboardInterruptRoundPipeThreads",
    "RoundPipeAborted",
    "RoundPipeThread",
    "RoundPipeTimeoutError",
    "RunState",
    "dump_all_active_threads",
    "get_wait_timeout",
    "is_threading_internal",
    "print_trimmed_traceback",
    "roundpipe_threads",
    "thread_exception_print_lock",
    "trim_traceback",
    "wait_event",
    "wait_until",
]

roundpipe_threads: list[RoundPipeThread] = []
thread_exception_print_lock = threading.Lock()
_POLL = 0.05


class KeyboardInterruptRoundPipeThreads(KeyboardInterrupt):
    """Raised when Ctrl-C arrives while RoundPipe waits for its worker threads."""


class RoundPipeTimeoutError(RoundPipeError, RuntimeError):
    """A RoundPipe wait exceeded its deadline (likely a deadlock or a stuck worker)."""


class RoundPipeAborted(Exception):
    """Internal: raised inside a worker when another worker failed and the step stops."""


def get_wait_timeout() -> float:
    """Deadline in seconds for pipeline-internal waits (``ROUNDPIPE_WAIT_TIMEOUT``)."""
    raw = os.environ.get("ROUNDPIPE_WAIT_TIMEOUT", "300")
    try:
        value = float(raw)
    except ValueError as e:
        raise RoundPipeValueError(
            f"ROUNDPIPE_WAIT_TIMEOUT must be a number of seconds, got {raw!r}"
        ) from e
    if value <= 0:
        raise RoundPipeValueError(f"ROUNDPIPE_WAIT_TIMEOUT must be positive, got {raw!r}")
    return value


def wait_until(
    predicate: Callable[[], bool],
    what: str,
    cond: threading.Condition | None = None,
    state: RunState | None = None,
    timeout: float | None = None,
) -> None:
    """Block until ``predicate()`` is true.

    Raises :class:`RoundPipeAborted` when ``state`` reports a failure elsewhere and
    :class:`RoundPipeTimeoutError` after ``timeout`` seconds (default: the global deadline).
    ``cond`` (if given) must be notified whenever the predicate may have changed.

    Example:
        >>> wait_until(lambda: True, "nothing")
    """
    deadline = time.monotonic() + (get_wait_timeout() if timeout is None else timeout)
    while True:
        if cond is not None:
            with cond:
                if predicate():
                    return
                cond.wait(_POLL)
        elif predicate():
            return
        else:
            time.sleep(_POLL / 10)
        if state is not None and state.failed():
            raise RoundPipeAborted(what)
        if time.monotonic() > deadline:
            raise RoundPipeTimeoutError(f"RoundPipe timed out waiting for {what}")


def wait_event(
    event: threading.Event,
    what: str,
    state: RunState | None = None,
    timeout: float | None = None,
) -> None:
    """Block until ``event`` is set, waking the moment it is (no polling delay).

    Like :func:`wait_until`: raises :class:`RoundPipeAborted` when ``state`` reports a failure
    elsewhere and :class:`RoundPipeTimeoutError` after ``timeout`` seconds (default: the global
    deadline).

    Example:
        >>> ev = threading.Event(); ev.set(); wait_event(ev, "ready")
    """
    deadline = time.monotonic() + (get_wait_timeout() if timeout is None else timeout)
    while not event.wait(_POLL):
        if state is not None and state.failed():
            raise RoundPipeAborted(what)
        if time.monotonic() > deadline:
            raise RoundPipeTimeoutError(f"RoundPipe timed out waiting for {what}")


class AnnotatedEvent(threading.Event):
    """Event whose waits are named (for debugging) and bounded.

    Example:
        >>> e = AnnotatedEvent("ready"); e.set(); e.wait_checked()
    """

    def __init__(self, name: str, initially_set: bool = False) -> None:
        super().__init__()
        self.name = name
        if initially_set:
            self.set()

    def wait_checked(self, state: RunState | None = None, timeout: float | None = None) -> None:
        """Wait for the event; abort if ``state`` failed; raise on deadline."""
        wait_event(self, f"event {self.name!r}", state=state, timeout=timeout)

    def __repr__(self) -> str:
        return f"AnnotatedEvent({self.name!r}, set={self.is_set()})"


class AnnotatedSemaphore(threading.Semaphore):
    """Semaphore whose acquisitions are named and bounded.

    Example:
        >>> s = AnnotatedSemaphore("slots", 1); s.acquire_checked(); s.release()
    """

    def __init__(self, name: str, value: int = 1) -> None:
        super().__init__(value)
        self.name = name

    def acquire_checked(self, state: RunState | None = None, timeout: float | None = None) -> None:
        """Acquire one slot; abort if ``state`` failed; raise on deadline."""
        deadline = time.monotonic() + (get_wait_timeout() if timeout is None else timeout)
        while not self.acquire(timeout=_POLL):
            if state is not None and state.failed():
                raise RoundPipeAborted(f"semaphore {self.name!r}")
            if time.monotonic() > deadline:
                raise RoundPipeTimeoutError(f"RoundPipe timed out acquiring {self.name!r}")


class RunState:
    """Failure and completion bookkeeping shared by all threads of one pipelined run.

    The first exception raised by any worker is kept; every other wait then aborts with
    :class:`RoundPipeAborted`, so the whole step stops and the main thread re-raises it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.error: BaseException | None = None
        self.error_where: str = ""
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.pending = 0

    def failed(self) -> bool:
        """Whether any worker failed or an abort was requested."""
        return self.error is not None

    def fail(self, exc: BaseException, where: str) -> None:
        """Record ``exc`` (first one wins) and wake every waiter."""
        with self.cond:
            if self.error is None:
                self.error = exc
                self.error_where = where
            self.cond.notify_all()

    def add_jobs(self, n: int) -> None:
        """Register ``n`` more jobs that must finish before :meth:`join` returns."""
        with self.cond:
            self.pending += n

    def job_done(self) -> None:
        """Mark one job finished (successfully or not)."""
        with self.cond:
            self.pending -= 1
            self.cond.notify_all()

    def join(self) -> None:
        """Wait for all jobs; re-raise the first worker exception in the calling thread.

        Ctrl-C while waiting aborts the workers, waits for them to drain and raises
        :class:`KeyboardInterruptRoundPipeThreads`.
        """
        deadline = 2 * get_wait_timeout()  # workers' own, more precise timeouts come first
        try:
            wait_until(
                lambda: self.pending <= 0 or self.failed(),
                f"run {self.name!r}",
                cond=self.cond,
                timeout=deadline,
            )
            if self.failed():
                # let the other workers reach an abort point so devices are idle again; a
                # worker stuck inside user code must not hide the original error
                try:
                    wait_until(
                        lambda: self.pending <= 0,
                        "workers to stop",
                        cond=self.cond,
                        timeout=deadline,
                    )
                except RoundPipeTimeoutError:
                    pass
        except KeyboardInterrupt:
            self.fail(KeyboardInterruptRoundPipeThreads(), "main thread")
            try:
                wait_until(lambda: self.pending <= 0, "workers to stop", cond=self.cond, timeout=30)
            finally:
                raise KeyboardInterruptRoundPipeThreads(
                    f"interrupted while waiting for RoundPipe run {self.name!r}"
                ) from None
        except RoundPipeTimeoutError:
            self.fail(RoundPipeTimeoutError("main thread gave up"), "main thread")
            raise
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Re-raise the recorded worker exception with a trimmed traceback."""
        err = self.error
        if err is None:
            return
        if isinstance(err, KeyboardInterruptRoundPipeThreads):
            raise err
        if (
            hasattr(err, "add_note")
            and self.error_where
            and not getattr(err, "_roundpipe_noted", False)
        ):
            err.add_note(f"(raised in RoundPipe {self.error_where})")
            err._roundpipe_noted = True  # type: ignore[attr-defined]
        raise err.with_traceback(trim_traceback(err.__traceback__))


def is_threading_internal(frame: FrameType) -> bool:
    """Whether ``frame`` belongs to Python's or RoundPipe's threading machinery."""
    filename = frame.f_code.co_filename
    return filename == threading.__file__ or filename == __file__


def trim_traceback(tb: TracebackType | None) -> TracebackType | None:
    """Drop threading-internal frames from the head of ``tb``."""
    while tb is not None and is_threading_internal(tb.tb_frame):
        tb = tb.tb_next
    return tb


def print_trimmed_traceback(frame: FrameType | None) -> None:
    """Print the stack ending at ``frame`` without threading-internal frames."""
    frames = []
    while frame is not None:
        if not is_threading_internal(frame):
            frames.append(frame)
        frame = frame.f_back
    summary = traceback.StackSummary.extract((f, f.f_lineno) for f in reversed(frames))
    sys.stderr.write("".join(summary.format()))


class RoundPipeThread(threading.Thread):
    """Daemon thread that reports uncaught exceptions instead of dying silently.

    Example:
        >>> t = RoundPipeThread(target=lambda: None, name="demo"); t.start(); t.join(1)
    """

    def __init__(self, target: Callable[..., Any], name: str, **kwargs: Any) -> None:
        self._rp_target = target
        super().__init__(target=self._run_wrapped, name=name, daemon=True, **kwargs)
        self.is_active = False
        # forget finished threads: devices are re-created many times in one process
        roundpipe_threads[:] = [t for t in roundpipe_threads if t.is_alive()]
        roundpipe_threads.append(self)

    def _run_wrapped(self) -> None:
        try:
            self._rp_target()
        except BaseException:  # noqa: BLE001 - a dead worker must be visible
            with thread_exception_print_lock:
                sys.stderr.write(f"RoundPipe thread {self.name!r} crashed:\n")
                traceback.print_exc()


def dump_all_active_threads() -> None:
    """Print trimmed stacks of every RoundPipe thread currently running user work."""
    frames = sys._current_frames()
    with thread_exception_print_lock:
        for t in roundpipe_threads:
            if t.is_active and t.ident in frames:
                sys.stderr.write(f"--- RoundPipe thread {t.name} ---\n")
                print_trimmed_traceback(frames[t.ident])
