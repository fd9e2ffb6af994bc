"""The optimizer "stream": one daemon thread that runs optimizer work in launch order.

The thread is created on first use. A failing kernel does not kill the thread; its
exception is re-raised in the main thread by the next :func:`synchronize_optim` or
:func:`raise_pending_error`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from ..devices.threads import RoundPipeThread, trim_traceback, wait_until
from ..runtime.context import OptimizerCtx

__all__ = [
    "OPTIM_STOP",
    "kernel_queue",
    "launch_optim_kernel",
    "on_optim_stream",
    "optim_thread",
    "raise_pending_error",
    "shutdown_optim",
    "synchronize_optim",
]

KernelQueueType = "queue.Queue[tuple[Callable, tuple, dict[str, Any]]]"
kernel_queue: queue.Queue = queue.Queue()
OPTIM_STOP = object()
optim_thread: RoundPipeThread | None = None
_lock = threading.Lock()
_cond = threading.Condition()
_pending = 0
_error: BaseException | None = None


def controller() -> None:
    """Optimizer thread body: run kernels until :data:`OPTIM_STOP`."""
    global _pending, _error
    thread = threading.current_thread()
    while True:
        item = kernel_queue.get()
        if item is OPTIM_STOP:
            return
        fn, args, kwargs = item
        thread.is_active = True  # type: ignore[attr-defined]
        try:
            with OptimizerCtx():
                fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            with _cond:
                if _error is None:
                    _error = exc
        finally:
            thread.is_active = False  # type: ignore[attr-defined]
            with _cond:
                _pending -= 1
                _cond.notify_all()


def _ensure_thread() -> None:
    global optim_thread
    with _lock:
        if optim_thread is None or not optim_thread.is_alive():
            optim_thread = RoundPipeThread(controller, name="roundpipe-optimizer")
            optim_thread.start()


def launch_optim_kernel(fn: Callable, *args: Any, **kwargs: Any) -> None:
    """Queue ``fn(*args, **kwargs)`` on the optimizer thread (runs inside ``OptimizerCtx``).

    Example:
        >>> out = []
        >>> launch_optim_kernel(out.append, 1); synchronize_optim(); out
        [1]
    """
    global _pending
    if on_optim_stream():
        fn(*args, **kwargs)
        return
    _ensure_thread()
    with _cond:
        _pending += 1
    kernel_queue.put((fn, args, kwargs))


def on_optim_stream() -> bool:
    """Whether the calling thread is the optimizer thread."""
    return optim_thread is not None and threading.current_thread() is optim_thread


def raise_pending_error() -> None:
    """Re-raise (once) an exception raised by an optimizer kernel."""
    global _error
    with _cond:
        err, _error = _error, None
    if err is not None:
        if hasattr(err, "add_note"):
            err.add_note("(raised in the RoundPipe optimizer thread)")
        raise err.with_traceback(trim_traceback(err.__traceback__))


def synchronize_optim() -> None:
    """Wait until every launched optimizer kernel finished; re-raise a kernel's exception."""
    if on_optim_stream():
        return
    wait_until(lambda: _pending == 0, "the optimizer thread", _cond)
    raise_pending_error()


def shutdown_optim() -> None:
    """Stop the optimizer thread after the queued kernels."""
    global optim_thread
    if optim_thread is not None and optim_thread.is_alive():
        kernel_queue.put(OPTIM_STOP)
        optim_thread.join(timeout=30)
    optim_thread = None
