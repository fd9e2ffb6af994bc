"""Devices that RoundPipe streams layers to: a worker thread, an uploader thread and copy engines
each.

Two backends share one interface (:class:`~roundpipe.devices.backend.DeviceBackend`: streams
and events, copies to and from the host, pinning, memory, synchronization); a
:class:`DeviceManager` calls its backend (``device.backend``) instead of branching on the kind:

* ``cuda``: one :class:`DeviceManager` per GPU with streams ``param_upstream`` (stage parameters,
  host -> device), ``upstream`` (activations in), ``compute_stream``, ``downstream`` (activations
  out) and ``grad_downstream`` (gradients out); host buffers are pinned so copies run
  asynchronously, and events order the streams.
* ``cpu``: *virtual* devices (``ROUNDPIPE_VIRTUAL_DEVICES=N``, the default when no GPU exists).
  "Device memory" is ordinary CPU memory: stage parameters are used in place (no copy is needed
  where host and device memory are one), activations and buffers are copied. Each device has two
  copy engines (:mod:`roundpipe.devices.link`), host -> device and device -> host, whose lanes stand in for
  the CUDA copy streams. With ``ROUNDPIPE_VIRTUAL_LINK_GBPS`` every transfer holds its engine for
  ``bytes / bandwidth`` of wall time on the engine's own thread, so transfers overlap compute as
  DMA does on a GPU; without it, copies run inline at no extra cost.

An optional per-device budget (``ROUNDPIPE_DEVICE_MEMORY``, e.g. ``"64MiB"``) is enforced on the
bytes RoundPipe keeps resident: uploading more than the budget raises :class:`DeviceMemoryError`.

**Overlap.** Where copies are asynchronous (CUDA, or a modelled link), a device prepares the
uploads of its queued stages on its uploader thread while its worker computes the current one
(*prefetch*): one stage ahead on a GPU, as many as the budget holds on a virtual device
(:attr:`DeviceManager.prefetch_depth`); a stage whose upload does not fit the budget is uploaded
when it starts (never a wait for memory), and nothing behind it is prepared before. A stage's
gradients download on the d2h copy engine while the next stage computes; on a modelled link,
activations leave for the host in the background too, and the next microbatch's inputs cross
while the current one computes (:func:`roundpipe.devices.transfer.prefetch_h2d`).
``ROUNDPIPE_PREFETCH=0`` turns stage prefetch off (read at each RoundPipe call); gradient
downloads stay asynchronous.

Nothing here runs at import time: devices are created on first use (or by
:func:`init_devices`), so importing RoundPipe never touches an accelerator.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..errors import RoundPipeError, RoundPipeRuntimeError, RoundPipeValueError
from .backend import DeviceBackend
from .cuda_backend import CudaBackend
from .link import (
    TRACE_LIMIT,
    CopyEngine,
    CopyEvent,  # noqa: F401 - the docstring examples use it
    TraceRecord,
    check_gbps,
    link_gbps_from_env,
)
from .threads import RoundPipeThread, RunState, get_wait_timeout, wait_event, wait_until
from .units import parse_bytes
from .virtual_backend import VirtualBackend

__all__ = [
    "PREFETCH_ENV",
    "DeviceManager",
    "DeviceMemoryError",
    "MemoryAccount",
    "UPLOAD_MARK_LIMIT",
    "cur_device",
    "device_list",
    "get_devices",
    "get_min_gpu_memory",
    "get_next_device",
    "get_num_devices",
    "init_devices",
    "make_backend",
    "prefetch_enabled",
    "shutdown_devices",
    "wait_devices_idle",
]

GB = 1024**3
# most pending stage-upload events a device keeps (DeviceManager.mark_upload)
UPLOAD_MARK_LIMIT = 64
PREFETCH_ENV = "ROUNDPIPE_PREFETCH"


def prefetch_enabled() -> bool:
    """Whether RoundPipe overlaps transfers with compute: ``ROUNDPIPE_PREFETCH`` is ``1`` (the
    default) or ``0``.

    On: a device uploads its next stage while it computes the current one. Off: each stage
    uploads when it starts, so upload and compute times add up. Either way the results are the
    same, and gradients download in the background; only devices with asynchronous copies (CUDA,
    a modelled link) have anything to overlap.

    Example:
        >>> os.environ[PREFETCH_ENV] = "0"; prefetch_enabled()
        False
        >>> del os.environ[PREFETCH_ENV]; prefetch_enabled()
        True
    """
    raw = os.environ.get(PREFETCH_ENV, "1").strip()
    if raw not in ("0", "1"):
        raise RoundPipeValueError(f"{PREFETCH_ENV} must be 0 (off) or 1 (on), got {raw!r}")
    return raw == "1"


class DeviceMemoryError(RoundPipeError, MemoryError):
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

    def try_allocate(self, nbytes: int) -> bool:
        """Account ``nbytes`` more resident bytes if they fit the budget; say whether they did.

        Example:
            >>> acc = MemoryAccount("dev0", budget=100)
            >>> acc.try_allocate(60), acc.try_allocate(60), acc.resident
            (True, False, 60)
        """
        with self._lock:
            if self.budget is not None and self.resident + nbytes > self.budget:
                return False
            self.resident += nbytes
            self.peak = max(self.peak, self.resident)
            return True

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


def make_backend(device: torch.device, link_gbps: float | None = None) -> DeviceBackend:
    """The backend of ``device``: :class:`~roundpipe.devices.cuda_backend.CudaBackend` for a GPU,
    :class:`~roundpipe.devices.virtual_backend.VirtualBackend` for a CPU virtual device.

    Example:
        >>> type(make_backend(torch.device("cpu"))).__name__
        'VirtualBackend'
    """
    if device.type == "cuda":
        return CudaBackend(device, link_gbps)
    if device.type == "cpu":
        return VirtualBackend(device, link_gbps)
    raise RoundPipeValueError(f"no RoundPipe device backend for {device.type!r} devices")


class _Job:
    """One queued stage job and, when it has a ``prepare`` callable, the upload prepared for it
    on the device's uploader thread (``prepared``, or ``error``; ``ready`` once either is set)."""

    __slots__ = (
        "state",
        "what",
        "fn",
        "args",
        "prepare",
        "ready",
        "prepared",
        "error",
        "claimed",
        "staged",
    )

    def __init__(
        self,
        state: RunState,
        what: str,
        fn: Callable[..., None],
        args: tuple,
        prepare: Callable[[], Any] | None,
    ) -> None:
        self.state = state
        self.what = what
        self.fn = fn
        self.args = args
        self.prepare = prepare
        self.ready: threading.Event | None = None  # set once the preparation was requested
        self.prepared: Any = None
        self.error: BaseException | None = None
        self.claimed = False
        self.staged = False  # the job holds its stage: the next job may be prepared


class DeviceManager:
    """Streams (or copy engines), memory account and threads of one device.

    The worker thread executes queued jobs one at a time; a job's exception is recorded in its
    :class:`~roundpipe.threads.RunState` (never lost), which stops the whole run. Which jobs
    exist is not this module's business: :mod:`roundpipe.run` queues its stage jobs here with
    :meth:`submit`, so devices sit below the runtime in the import layers.

    A job may come with a ``prepare`` callable (the stage's upload). Where copies are
    asynchronous (:attr:`async_copies`), once the running job holds its own stage it calls
    :meth:`prefetch_next`, and the uploader thread runs ``prepare`` for the job queued behind it,
    so the next stage's parameters move while the current stage computes; that job collects the
    result with :meth:`take_prepared` (None: prepare found no room, the job uploads itself). The
    running job always gets its memory before the next one can take any. A prepared result the
    job never claimed (it was skipped after a failure) is freed when the job ends.

    ``trace`` keeps the latest :data:`~roundpipe.devices.link.TRACE_LIMIT` spans of transfers run by the
    copy engines and of stage computes (:class:`~roundpipe.devices.link.TraceRecord`).
    """

    def __init__(
        self,
        id: int,
        device: torch.device,
        budget: int | None = None,
        link_gbps: float | None = None,
    ) -> None:
        self.id = id
        self.device = device
        self.backend: DeviceBackend = make_backend(device, link_gbps)
        self.is_cuda = self.backend.is_cuda
        self.supports_pinning = self.backend.supports_pinning
        self.link_gbps = link_gbps
        # copies run beside compute: the next stage can be prefetched
        self.async_copies = self.backend.async_copies
        # how many queued jobs the uploader may prepare ahead of the running one (None: as many
        # as the memory budget holds). A GPU keeps one (its memory is real and unbudgeted by
        # default); a virtual device uploads as early as its budget allows.
        self.prefetch_depth: int | None = self.backend.prefetch_depth
        # activation bytes a stage job uploads (its inputs, all microbatches), smoothed over
        # jobs: what the planner weighs against the link (ModelExecutePlan.auto)
        self.activation_bytes_per_stage: float | None = None
        self._job_activation_bytes = 0
        self.shutdown = False
        self.memory = MemoryAccount(f"{device.type}:{id}", budget)
        self.trace: collections.deque[TraceRecord] = collections.deque(maxlen=TRACE_LIMIT)
        streams = self.backend.create_streams(f"device-{id}", self.trace)
        self.param_upstream: Any = streams.param_upstream
        self.upstream: Any = streams.upstream
        self.compute_stream: Any = streams.compute_stream
        self.downstream: Any = streams.downstream
        self.grad_downstream: Any = streams.grad_downstream
        self.h2d: CopyEngine | None = streams.h2d
        self.d2h: CopyEngine = streams.d2h
        name = f"device-{id}"
        # pending stage-upload events (mark_upload); bounded
        self.upload_mark: collections.deque[Any] = collections.deque(maxlen=UPLOAD_MARK_LIMIT)
        self._mark_lock = threading.Lock()
        self._cv = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._uploads: collections.deque[_Job] = collections.deque()
        self._uploading: _Job | None = None
        self.cur_job: _Job | None = None
        self.controller_thread = RoundPipeThread(self.controller, name=f"roundpipe-{name}")
        self.controller_thread.start()
        self.uploader_thread: RoundPipeThread | None = None
        if self.async_copies:
            self.uploader_thread = RoundPipeThread(self._uploader, name=f"roundpipe-{name}-upload")
            self.uploader_thread.start()

    def __repr__(self) -> str:
        link = f", link={self.link_gbps} GB/s" if self.link_gbps is not None else ""
        return f"DeviceManager({self.device}, id={self.id}, budget={self.memory.budget}{link})"

    # -- streams and events -------------------------------------------------------------
    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context that makes ``stream`` current (no-op on CPU)."""
        return self.backend.stream(stream)

    def new_event(self) -> Any:
        """A fresh event on this device: a CUDA event, or a :class:`~roundpipe.devices.link.CopyEvent`
        that a copy lane completes (``event.record(lane)``)."""
        return self.backend.new_event()

    def wait_stream(self, waiter: Any, wait_for: Any) -> None:
        """Make ``waiter`` wait for all work queued on ``wait_for``."""
        waiter.wait_stream(wait_for)

    def hold_link(self, lane: Any, kind: str, what: str, nbytes: int) -> None:
        """Occupy ``lane``'s link (a CPU copy lane) for a transfer of ``nbytes`` in the calling
        thread, which waits for that transfer anyway: the modelled link time of a copy it made
        itself (:meth:`roundpipe.devices.link.CopyLane.hold`). No-op without a link."""
        if self.link_gbps is not None and nbytes:
            lane.hold(kind, what, nbytes)

    def mark_upload(self, event: Any) -> None:
        """Remember ``event``, the completion of a stage upload, until it completes.

        Only events still pending are kept: stage uploads complete in order on their lane /
        stream, so completed marks are dropped from the front, and past
        :data:`UPLOAD_MARK_LIMIT` pending marks the oldest is dropped (waiting for a newer mark
        covers it). The list therefore stays bounded for the life of the process.

        Example:
            >>> dev = DeviceManager(0, torch.device("cpu"))
            >>> for _ in range(1000):
            ...     dev.mark_upload(CopyEvent())
            >>> len(dev.upload_mark)  # complete marks are dropped: only the newest is kept
            1
            >>> dev.shutdown_controller()
        """
        with self._mark_lock:
            while self.upload_mark and self.upload_mark[0].query():
                self.upload_mark.popleft()
            self.upload_mark.append(event)

    def flush_upload_marks(self) -> list[Any]:
        """Return the still-pending upload events and clear the list."""
        with self._mark_lock:
            marks = list(self.upload_mark)
            self.upload_mark.clear()
        return [m for m in marks if not m.query()]

    def synchronize(self) -> None:
        """Block the calling thread until this device's copies and kernels are complete."""
        for ev in self.flush_upload_marks():
            ev.synchronize()
        self.backend.synchronize()
        for engine in (self.h2d, self.d2h):
            if engine is not None:
                engine.wait_idle()

    def wait_activation_copies(self) -> None:
        """Wait until the activation copies queued to the host landed (a modelled link's d2h
        copies complete in the background; elsewhere they are complete on return)."""
        if self.link_gbps is not None:
            self.d2h.express.synchronize()

    def count_activation_upload(self, nbytes: int) -> None:
        """Record ``nbytes`` of stage input uploaded by the running job (see
        :attr:`activation_bytes_per_stage`)."""
        self._job_activation_bytes += nbytes

    def _fold_activation_bytes(self) -> None:
        nbytes, self._job_activation_bytes = self._job_activation_bytes, 0
        if nbytes:
            old = self.activation_bytes_per_stage
            self.activation_bytes_per_stage = nbytes if old is None else 0.7 * old + 0.3 * nbytes

    def drain_downloads(self) -> None:
        """Wait until the gradient downloads in flight landed (and freed their stages)."""
        self.d2h.wait_idle()

    # -- jobs ---------------------------------------------------------------------------
    def submit(
        self,
        state: RunState,
        what: str,
        fn: Callable[..., None],
        *args: Any,
        prepare: Callable[[], Any] | None = None,
    ) -> None:
        """Queue ``fn(*args)`` on this device's worker, tracked by ``state``; ``prepare`` (run
        on the uploader thread ahead of the job, see :meth:`take_prepared`) is used only where
        copies are asynchronous."""
        if self.shutdown:
            raise RoundPipeRuntimeError(f"{self} has been shut down")
        job = _Job(state, what, fn, args, prepare if self.async_copies else None)
        state.add_jobs(1)
        with self._cv:
            self._queue.append(job)
            self._advance_prefetch()  # it may be next in line: prepare it while others run
            self._cv.notify_all()

    def _request(self, job: _Job) -> None:
        """Queue ``job``'s preparation on the uploader (caller holds ``_cv``)."""
        if job.prepare is not None and job.ready is None:
            job.ready = threading.Event()
            self._uploads.append(job)
            self._cv.notify_all()

    def _advance_prefetch(self) -> None:
        """Request the preparation of the next queued job that may be prepared now (caller holds
        ``_cv``).

        Jobs are prepared in queue order, one at a time, and only while the running job holds
        its stage (it got its memory first). Past the first queued job, a job is prepared only
        once every job before it was prepared with room to spare, up to :attr:`prefetch_depth`
        jobs ahead: a preparation that found no room (or failed) stops the chain, so a job
        uploading for itself never finds its memory taken by a later one.
        """
        running = self.cur_job
        if running is None or not running.staged:
            return
        for depth, job in enumerate(self._queue):
            if self.prefetch_depth is not None and depth >= self.prefetch_depth:
                return
            if job.prepare is None:
                return
            if job.ready is None:
                self._request(job)
                return
            if not job.ready.is_set() or job.prepared is None or job.error is not None:
                return  # still preparing, or no room for it: nothing behind it yet

    def prefetch_next(self) -> None:
        """In a job that now holds its stage: start preparing the next queued job(s)."""
        with self._cv:
            job = self.cur_job
            if job is None or threading.current_thread() is not self.controller_thread:
                return
            job.staged = True
            self._advance_prefetch()

    def take_prepared(self, state: RunState | None = None) -> Any:
        """In a job: the result of its ``prepare`` (waiting for the uploader), or None when it
        has none. Re-raises the preparation's error."""
        job = self.cur_job
        if (
            job is None
            or job.ready is None
            or threading.current_thread() is not self.controller_thread
        ):
            return None
        wait_event(job.ready, f"the upload of {job.what}", state)
        job.claimed = True
        if job.error is not None:
            raise job.error
        return job.prepared

    def _release(self, job: _Job) -> None:
        """Free what the uploader prepared for ``job`` if the job never claimed it."""
        if job.ready is None or job.claimed:
            return
        wait_event(job.ready, f"the upload of {job.what}")
        free = getattr(job.prepared, "free", None)
        job.prepared = None
        if free is not None:
            free()

    def controller(self) -> None:
        """Worker loop: run queued jobs until shut down."""
        thread = threading.current_thread()
        while True:
            with self._cv:
                while not self._queue and not self.shutdown:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self.cur_job = job
            thread.is_active = True  # type: ignore[attr-defined]
            self._job_activation_bytes = 0
            try:
                if not job.state.failed():
                    with self._job_scope():
                        job.fn(*job.args)
                    self._fold_activation_bytes()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                job.state.fail(exc, f"worker {thread.name} ({job.what})")
            finally:
                try:
                    self._release(job)
                except BaseException as exc:  # noqa: BLE001
                    job.state.fail(exc, f"worker {thread.name} ({job.what})")
                thread.is_active = False  # type: ignore[attr-defined]
                with self._cv:
                    self.cur_job = None
                    self._cv.notify_all()
                job.state.job_done()

    def _uploader(self) -> None:
        """Uploader loop: prepare (upload) stages in job order, ahead of the worker."""
        thread = threading.current_thread()
        while True:
            with self._cv:
                while not self._uploads and not self.shutdown:
                    self._cv.wait()
                if not self._uploads:
                    return
                job = self._uploads.popleft()
                self._uploading = job
            thread.is_active = True  # type: ignore[attr-defined]
            try:
                if not job.state.failed():
                    with self._device_scope():
                        job.prepared = job.prepare()  # type: ignore[misc]
            except BaseException as exc:  # noqa: BLE001 - re-raised by the job itself
                job.error = exc
            finally:
                thread.is_active = False  # type: ignore[attr-defined]
                assert job.ready is not None
                job.ready.set()
                with self._cv:
                    self._uploading = None
                    self._advance_prefetch()  # room to spare: the job behind it may go next
                    self._cv.notify_all()

    def _device_scope(self) -> contextlib.AbstractContextManager:
        """Make this device current (CUDA); nothing to set up on CPU."""
        return self.backend.device_scope()

    def _job_scope(self) -> contextlib.AbstractContextManager:
        """Jobs compute on this device's compute stream (CUDA); nothing to set up on CPU."""
        return self.backend.job_scope(self.compute_stream)

    def idle(self) -> bool:
        """Whether no job is queued or running and no transfer is in flight."""
        with self._cv:
            if self._queue or self.cur_job is not None or self._uploads or self._uploading:
                return False
        return not any(e is not None and e.busy() for e in (self.h2d, self.d2h))

    def shutdown_controller(self) -> None:
        """Stop the worker and uploader threads after their queued work, then the engines."""
        with self._cv:
            self.shutdown = True
            self._cv.notify_all()
        timeout = get_wait_timeout()
        self.controller_thread.join(timeout=timeout)
        if self.uploader_thread is not None:
            self.uploader_thread.join(timeout=timeout)
        for engine in (self.h2d, self.d2h):
            if engine is not None:
                engine.shutdown()


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
    link_gbps: float | None = None,
) -> list[DeviceManager]:
    """(Re)create the device managers.

    Args:
        num_virtual: number of CPU virtual devices. Implies ``backend="cpu"``.
        memory_limit: per-device budget in bytes (or ``"64MiB"``) for CPU virtual devices.
        backend: ``"cpu"`` or ``"cuda"``; default: ``cuda`` if available and
            ``ROUNDPIPE_VIRTUAL_DEVICES`` is unset, else ``cpu``.
        link_gbps: modelled host <-> device bandwidth of CPU virtual devices in GB/s (see
            :mod:`roundpipe.devices.link`); default ``ROUNDPIPE_VIRTUAL_LINK_GBPS``, else none (copies
            run inline, taking only the time they take).

    Must not be called while a RoundPipe run is in flight.

    Example:
        >>> devs = init_devices(num_virtual=2, memory_limit="1MiB")
        >>> [d.memory.budget for d in devs]
        [1048576, 1048576]
        >>> init_devices(num_virtual=1, link_gbps=16)[0].link_gbps
        16.0
    """
    global cur_device
    env_n = os.environ.get("ROUNDPIPE_VIRTUAL_DEVICES")
    if backend is None:
        if num_virtual is not None or env_n or not torch.cuda.is_available():
            backend = "cpu"
        else:
            backend = "cuda"
    if backend not in ("cpu", "cuda"):
        raise RoundPipeValueError(f"backend must be 'cpu' or 'cuda', got {backend!r}")
    budget = (
        parse_bytes(memory_limit, "memory_limit") if memory_limit is not None else _default_budget()
    )
    if backend == "cpu":
        link_gbps = (
            link_gbps_from_env() if link_gbps is None else check_gbps(link_gbps, "link_gbps")
        )
    elif link_gbps is not None:
        raise RoundPipeValueError(
            "link_gbps models the link of CPU virtual devices; use backend='cpu'"
        )
    with _init_lock:
        shutdown_devices()
        if backend == "cuda":
            if not torch.cuda.is_available():
                raise RoundPipeRuntimeError("backend='cuda' requested but CUDA is not available")
            n = torch.cuda.device_count()
            device_list.extend(DeviceManager(i, torch.device("cuda", i), budget) for i in range(n))
        else:
            if num_virtual is None:
                try:
                    num_virtual = int(env_n) if env_n else 1
                except ValueError as e:
                    raise RoundPipeValueError(
                        f"ROUNDPIPE_VIRTUAL_DEVICES must be an integer, got {env_n!r}"
                    ) from e
            if not isinstance(num_virtual, int) or isinstance(num_virtual, bool) or num_virtual < 1:
                raise RoundPipeValueError(
                    f"num_virtual must be a positive int, got {num_virtual!r}"
                )
            device_list.extend(
                DeviceManager(i, torch.device("cpu"), budget, link_gbps) for i in range(num_virtual)
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
        else:
            sizes.append(d.backend.available_bytes(len(devs)) / GB)
    return min(sizes)


def wait_devices_idle(timeout: float | None = None) -> None:
    """Wait until no device has queued or running jobs, uploads or transfers."""
    wait_until(
        lambda: all(d.idle() for d in device_list), "devices to become idle", timeout=timeout
    )
