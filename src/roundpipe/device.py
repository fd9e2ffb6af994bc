"""Devices that RoundPipe streams layers to, one worker thread each.

Two backends share one interface:

* ``cuda``: one :class:`DeviceManager` per GPU with upload / compute / download streams and
  events; host buffers are pinned so copies run asynchronously.
* ``cpu``: *virtual* devices (``ROUNDPIPE_VIRTUAL_DEVICES=N``, the default when no GPU exists).
  "Device memory" is ordinary CPU memory, copies are real copies, streams and events are
  no-ops (CPU ops complete synchronously), and an optional per-device budget
  (``ROUNDPIPE_DEVICE_MEMORY``, e.g. ``"64MiB"``) is enforced on the bytes RoundPipe keeps
  resident: uploading more than the budget raises :class:`DeviceMemoryError`.

Nothing here runs at import time: devices are created on first use (or by
:func:`init_devices`), so importing RoundPipe never touches an accelerator.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from .threads import RoundPipeThread, RunState, get_wait_timeout, wait_until
from .utils import parse_bytes

__all__ = [
    "DeviceManager",
    "DeviceMemoryError",
    "InterStreamMemManager",
    "MemoryAccount",
    "UPLOAD_MARK_LIMIT",
    "cur_device",
    "device_list",
    "gc_collect",
    "get_devices",
    "get_min_gpu_memory",
    "get_next_device",
    "get_num_devices",
    "init_devices",
    "shutdown_devices",
]

GB = 1024**3
# most upload-stream events a device keeps (DeviceManager.mark_upload)
UPLOAD_MARK_LIMIT = 64


class DeviceMemoryError(MemoryError):
    """RoundPipe tried to keep more bytes resident on a device than its budget allows."""


class MemoryAccount:
    """Thread-safe accounting of the bytes RoundPipe holds on one device.

    Example:
        >>> acc = MemoryAccount("dev0", budget=100)
        >>> acc.allocate(60, "layer 0"); acc.free(60); acc.peak
        60
    """

    def __init__(self, name: str, budget: int | None) -> None:
        self.name = name
        self.budget = budget
        self.resident = 0
        self.peak = 0
        self._lock = threading.Lock()

    def allocate(self, nbytes: int, what: str) -> None:
        """Account ``nbytes`` more resident bytes, or raise if the budget would overflow."""
        with self._lock:
            if self.budget is not None and self.resident + nbytes > self.budget:
                raise DeviceMemoryError(
                    f"{self.name}: {what} needs {nbytes} bytes but only "
                    f"{self.budget - self.resident} of the {self.budget}-byte budget are free; "
                    "use more pipeline stages (a smaller model_memory_limit) or a larger budget"
                )
            self.resident += nbytes
            self.peak = max(self.peak, self.resident)

    def free(self, nbytes: int) -> None:
        """Release ``nbytes`` previously allocated."""
        with self._lock:
            self.resident -= nbytes
            assert self.resident >= 0, f"{self.name}: memory accounting went negative"

    def reset_peak(self) -> None:
        """Restart peak tracking from the current resident bytes."""
        with self._lock:
            self.peak = self.resident


class _NullStream:
    """Stream stand-in for CPU virtual devices, where every op completes synchronously."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _DoneEvent:
        return _DoneEvent()


class _DoneEvent:
    """Event stand-in for CPU virtual devices: always complete."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass


class InterStreamMemManager:
    """Keeps storages alive until every stream that used them has passed a marker event.

    On CUDA, freeing a tensor allocated on one stream while another stream still reads it
    would let the caching allocator hand the memory out too early; holding a reference until
    an event recorded on each using stream completes prevents that (the alternative to
    ``Tensor.record_stream``). On CPU virtual devices the markers are always complete, so a
    storage is released at the next :meth:`stream_synced`.

    Example:
        >>> mm = InterStreamMemManager()
        >>> mm.free(torch.ones(4).untyped_storage(), _NullStream())
        >>> len(mm.free_queue), (mm.stream_synced(), len(mm.free_queue))[1]
        (1, 0)
    """

    def __init__(self, *streams: Any) -> None:
        self.streams = streams
        self.free_queue: list[tuple[Any, list[Any]]] = []
        self.in_use: dict[int, tuple[Any, list[Any]]] = {}
        self._lock = threading.Lock()

    def record_stream(self, tensor: torch.Tensor, from_stream: Any, use_stream: Any) -> None:
        """Note that ``tensor`` (last used on ``from_stream``) is now used on ``use_stream``."""
        storage = tensor.untyped_storage()
        with self._lock:
            _, used = self.in_use.setdefault(storage.data_ptr(), (storage, [from_stream]))
            if used[-1] is not from_stream:
                raise RuntimeError("record_stream: the tensor was last used on another stream")
            used.append(use_stream)

    def free(self, storage: Any, *use_streams: Any) -> None:
        """Hold ``storage`` until all ``use_streams`` have finished the work queued so far."""
        if not use_streams:
            return
        events = [s.record_event() for s in use_streams]
        with self._lock:
            self.free_queue.append((storage, events))

    def stream_synced(self, waiter: Any = None, wait_for: Any = None) -> None:
        """Release every held storage whose marker events completed."""
        with self._lock:
            self.free_queue = [e for e in self.free_queue if not all(ev.query() for ev in e[1])]

    def flush(self) -> None:
        """Move every tracked in-use storage to the free queue."""
        with self._lock:
            tracked, self.in_use = list(self.in_use.values()), {}
        for storage, streams in tracked:
            self.free(storage, *streams)

    def free_all(self) -> None:
        """Forget everything (call only when all streams are idle)."""
        with self._lock:
            self.free_queue.clear()
            self.in_use.clear()


class DeviceManager:
    """Streams, memory account and worker thread of one device.

    The worker executes queued jobs one at a time; a job's exception is recorded in its
    :class:`~roundpipe.threads.RunState` (never lost), which stops the whole run. Which
    jobs exist is not this module's business: :mod:`roundpipe.run` queues its stage jobs
    here with :meth:`submit`, so devices sit below the runtime in the import layers.
    """

    def __init__(self, id: int, device: torch.device, budget: int | None = None) -> None:
        self.id = id
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.supports_pinning = self.is_cuda
        self.shutdown = False
        self.memory = MemoryAccount(f"{device.type}:{id}", budget)
        if self.is_cuda:
            with torch.cuda.device(device):
                self.param_upstream: Any = torch.cuda.Stream(device)
                self.upstream: Any = torch.cuda.Stream(device)
                self.compute_stream: Any = torch.cuda.Stream(device)
                self.downstream: Any = torch.cuda.Stream(device)
        else:
            self.param_upstream = self.upstream = _NullStream()
            self.compute_stream = self.downstream = _NullStream()
        self.mem_manager = InterStreamMemManager(
            self.param_upstream, self.upstream, self.compute_stream, self.downstream
        )
        # events on the upload stream still pending (see mark_upload); bounded
        self.upload_mark: collections.deque[Any] = collections.deque(maxlen=UPLOAD_MARK_LIMIT)
        self._mark_lock = threading.Lock()
        self.jobs: queue.Queue = queue.Queue()
        self.cur_job: tuple | None = None
        self.controller_thread = RoundPipeThread(self.controller, name=f"roundpipe-device-{id}")
        self.controller_thread.start()

    def __repr__(self) -> str:
        return f"DeviceManager({self.device}, id={self.id}, budget={self.memory.budget})"

    # -- streams and events -------------------------------------------------------------
    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context that makes ``stream`` current (no-op on CPU)."""
        if self.is_cuda:
            return torch.cuda.stream(stream)
        return contextlib.nullcontext()

    def new_event(self) -> Any:
        """A fresh event on this device (always-complete stand-in on CPU)."""
        return torch.cuda.Event() if self.is_cuda else _DoneEvent()

    def wait_stream(self, waiter: Any, wait_for: Any) -> None:
        """Make ``waiter`` wait for all work queued on ``wait_for``."""
        waiter.wait_stream(wait_for)
        self.mem_manager.stream_synced(waiter, wait_for)

    def mark_upload(self) -> None:
        """Record an event on the upload stream after enqueuing host-to-device copies.

        Only events still pending are kept: the marks are recorded in order on one stream,
        which completes them in order, so completed ones are dropped from the front, and past
        :data:`UPLOAD_MARK_LIMIT` pending marks the oldest is dropped (waiting for a newer
        mark covers it). The list therefore stays bounded for the life of the process.

        Example:
            >>> dev = DeviceManager(0, torch.device("cpu"))
            >>> for _ in range(1000):
            ...     dev.mark_upload()
            >>> len(dev.upload_mark)  # CPU marks complete at once
            1
            >>> dev.shutdown_controller()
        """
        ev = self.new_event()
        if self.is_cuda:
            ev.record(self.upstream)
        with self._mark_lock:
            while self.upload_mark and self.upload_mark[0].query():
                self.upload_mark.popleft()
            self.upload_mark.append(ev)

    def flush_upload_marks(self) -> list[Any]:
        """Return the still-pending upload events and clear the list."""
        with self._mark_lock:
            marks = list(self.upload_mark)
            self.upload_mark.clear()
        return [m for m in marks if not m.query()]

    def synchronize(self) -> None:
        """Block the calling thread until all streams of this device are idle."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    # -- jobs ---------------------------------------------------------------------------
    def submit(self, state: RunState, what: str, fn: Callable[..., None], *args: Any) -> None:
        """Queue ``fn(*args)`` on this device's worker, tracked by ``state``."""
        if self.shutdown:
            raise RuntimeError(f"{self} has been shut down")
        state.add_jobs(1)
        self.jobs.put((state, what, fn, args))

    def controller(self) -> None:
        """Worker loop: run queued jobs until shut down."""
        thread = threading.current_thread()
        while not self.shutdown:
            try:
                item = self.jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                break
            state, what, fn, args = item
            self.cur_job = item
            thread.is_active = True  # type: ignore[attr-defined]
            try:
                if not state.failed():
                    with self._job_scope():
                        fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                state.fail(exc, f"worker {thread.name} ({what})")
            finally:
                thread.is_active = False  # type: ignore[attr-defined]
                self.cur_job = None
                state.job_done()

    def _job_scope(self) -> contextlib.AbstractContextManager:
        """Jobs compute on this device's compute stream (CUDA); nothing to set up on CPU."""
        if not self.is_cuda:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self.compute_stream))
        return stack

    def shutdown_controller(self) -> None:
        """Stop the worker thread after its queued jobs."""
        self.shutdown = True
        self.jobs.put(None)
        self.controller_thread.join(timeout=get_wait_timeout())


device_list: list[DeviceManager] = []
cur_device: int = 0
_init_lock = threading.Lock()


def _default_budget() -> int | None:
    raw = os.environ.get("ROUNDPIPE_DEVICE_MEMORY")
    return parse_bytes(raw, "ROUNDPIPE_DEVICE_MEMORY") if raw else None


def init_devices(
    num_virtual: int | None = None,
    memory_limit: int | str | None = None,
    backend: str | None = None,
) -> list[DeviceManager]:
    """(Re)create the device managers.

    Args:
        num_virtual: number of CPU virtual devices. Implies ``backend="cpu"``.
        memory_limit: per-device budget in bytes (or ``"64MiB"``) for CPU virtual devices.
        backend: ``"cpu"`` or ``"cuda"``; default: ``cuda`` if available and
            ``ROUNDPIPE_VIRTUAL_DEVICES`` is unset, else ``cpu``.

    Must not be called while a RoundPipe run is in flight.

    Example:
        >>> devs = init_devices(num_virtual=2, memory_limit="1MiB")
        >>> [d.memory.budget for d in devs]
        [1048576, 1048576]
    """
    global cur_device
    env_n = os.environ.get("ROUNDPIPE_VIRTUAL_DEVICES")
    if backend is None:
        if num_virtual is not None or env_n or not torch.cuda.is_available():
            backend = "cpu"
        else:
            backend = "cuda"
    if backend not in ("cpu", "cuda"):
        raise ValueError(f"backend must be 'cpu' or 'cuda', got {backend!r}")
    budget = (
        parse_bytes(memory_limit, "memory_limit") if memory_limit is not None else _default_budget()
    )
    with _init_lock:
        shutdown_devices()
        if backend == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("backend='cuda' requested but CUDA is not available")
            n = torch.cuda.device_count()
            device_list.extend(DeviceManager(i, torch.device("cuda", i), budget) for i in range(n))
        else:
            if num_virtual is None:
                try:
                    num_virtual = int(env_n) if env_n else 1
                except ValueError as e:
                    raise ValueError(
                        f"ROUNDPIPE_VIRTUAL_DEVICES must be an integer, got {env_n!r}"
                    ) from e
            if not isinstance(num_virtual, int) or isinstance(num_virtual, bool) or num_virtual < 1:
                raise ValueError(f"num_virtual must be a positive int, got {num_virtual!r}")
            device_list.extend(
                DeviceManager(i, torch.device("cpu"), budget) for i in range(num_virtual)
            )
        cur_device = 0
    return list(device_list)


def get_devices() -> list[DeviceManager]:
    """All device managers, creating the default set on first use."""
    if not device_list:
        init_devices()
    return device_list


def shutdown_devices() -> None:
    """Stop all device workers and forget them."""
    for d in device_list:
        d.shutdown_controller()
    device_list.clear()


def get_num_devices() -> int:
    """Number of managed devices."""
    return len(get_devices())


def get_next_device() -> DeviceManager:
    """Round-robin over the managed devices."""
    global cur_device
    devs = get_devices()
    d = devs[cur_device % len(devs)]
    cur_device = (cur_device + 1) % len(devs)
    return d


def get_min_gpu_memory() -> float:
    """Smallest memory (GB) available to RoundPipe on any device.

    For CPU virtual devices this is the budget, or an equal share of physical memory.
    """
    devs = get_devices()
    sizes = []
    for d in devs:
        if d.memory.budget is not None:
            sizes.append(d.memory.budget / GB)
        elif d.is_cuda:
            free, _ = torch.cuda.mem_get_info(d.device)
            sizes.append(free / GB)
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            sizes.append(total / len(devs) / GB)
    return min(sizes)


def gc_collect() -> None:
    """Release storages held by every device's inter-stream memory manager."""
    for d in device_list:
        d.mem_manager.stream_synced()


def wait_devices_idle(timeout: float | None = None) -> None:
    """Wait until no device worker has queued or running jobs."""
    wait_until(
        lambda: all(d.jobs.empty() and d.cur_job is None for d in device_list),
        "devices to become idle",
        timeout=timeout,
    )
