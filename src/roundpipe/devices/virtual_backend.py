"""The CPU virtual device backend: host memory is device memory, so stage parameters are used
in place and activations are copied; two copy engines (:mod:`roundpipe.devices.link`), host ->
device and device -> host, stand in for the copy streams. With a modelled link every transfer
holds its engine for ``bytes / bandwidth`` beside the compute, as DMA does on a GPU (see
:class:`~roundpipe.devices.backend.DeviceBackend`)."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import RoundPipeRuntimeError
from .backend import DeviceBackend, DeviceQueues, GradLanding, Streams, nbytes_of, set_slot
from .link import CopyEngine, CopyEvent

__all__ = ["CpuEvent", "NullStream", "VirtualBackend", "take_staged", "wait_arrived"]


class CpuEvent(CopyEvent):
    """The event of a CPU virtual device, with ``torch.cuda.Event``'s interface, so code that
    records and waits on a GPU's events runs unchanged on virtual devices.

    ``record(stream)`` on a copy lane completes once the work queued there so far has (a
    modelled link's transfers); on the compute "stream" (the worker thread, where work is done
    as soon as it is issued) or with no stream it completes at once. An event never recorded
    is complete, as a CUDA event is. ``wait`` / ``synchronize`` block the calling thread until
    completion, ``query`` tells whether it happened, ``elapsed_time`` gives the milliseconds
    between two completed, timed events.

    Example:
        >>> start, end = CpuEvent(enable_timing=True), CpuEvent(enable_timing=True)
        >>> start.record(); end.record(); end.synchronize()
        >>> end.query(), start.elapsed_time(end) >= 0.0
        (True, True)
    """

    __slots__ = ("enable_timing", "blocking", "interprocess", "_recorded")

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        super().__init__("event", "recorded work")
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.interprocess = interprocess
        self._recorded = False

    def __repr__(self) -> str:
        state = "done" if self.query() else "pending"
        recorded = "recorded" if self._recorded else "never recorded"
        return f"CpuEvent({recorded}, {state})"

    def record(self, stream: Any = None) -> None:
        """Complete once the work queued on ``stream`` so far has (at once off a copy lane)."""
        self._recorded = True
        self.start = self.end = time.perf_counter()
        super().record(stream)  # a lane stamps ``end`` when it reaches the marker

    def elapsed_time(self, end_event: CpuEvent) -> float:
        """Milliseconds from this event's completion to ``end_event``'s (both recorded, with
        ``enable_timing=True``); waits for both to complete first."""
        if not (self.enable_timing and getattr(end_event, "enable_timing", False)):
            raise RoundPipeRuntimeError(
                "elapsed_time needs both events created with CpuEvent(enable_timing=True)"
            )
        if not (self._recorded and end_event._recorded):
            raise RoundPipeRuntimeError("elapsed_time needs both events recorded (event.record())")
        self.synchronize()
        end_event.synchronize()
        return (end_event.end - self.end) * 1000.0


class NullStream:
    """Compute "stream" of a CPU virtual device: its worker thread, where every op completes
    before the next starts (work that must wait for a copy waits on the copy's event)."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> CopyEvent:
        """Record ``event`` (a new :class:`CpuEvent` if None): complete, as the work is done."""
        event = CpuEvent() if event is None else event
        event.record(self)
        return event


# host tensor -> the CopyEvent of its crossing to the host (to_host), and host tensor -> (device,
# CopyEvent) of its crossing to that device ahead of the upload (prefetch_to_device). Kept beside
# the tensors, not on them: a tensor handed to the user stays picklable and deep-copyable.
_arrivals: WeakIdKeyDictionary = WeakIdKeyDictionary()
_staged: WeakIdKeyDictionary = WeakIdKeyDictionary()
_marks_lock = threading.Lock()


def _mark(table: WeakIdKeyDictionary, t: torch.Tensor) -> Any:
    with _marks_lock:
        return table.get(t)


def wait_arrived(host_tensors: Sequence[Any]) -> None:
    """Block until host tensors a virtual device's :meth:`VirtualBackend.to_host` handed out
    have crossed its modelled link (a no-op for tensors with nothing in flight).

    Example:
        >>> wait_arrived([torch.ones(2), "not a tensor"])
    """
    for t in host_tensors:
        ev = _mark(_arrivals, t) if isinstance(t, torch.Tensor) else None
        if ev is not None:
            ev.synchronize()


def take_staged(dev: DeviceQueues, host_tensors: Sequence[Any]) -> list[Any]:
    """The tensors :meth:`VirtualBackend.prefetch_to_device` already moved to ``dev`` (waiting
    until they have); their staging is used up: a later upload crosses the link again."""
    staged = []
    for t in host_tensors:
        mark = _mark(_staged, t) if isinstance(t, torch.Tensor) else None
        if mark is None or mark[0] is not dev:
            continue
        mark[1].synchronize()
        with _marks_lock:
            _staged.pop(t, None)
        staged.append(t)
    return staged


def _waiter(event: CopyEvent) -> Callable[..., None]:
    def wait(module: nn.Module, args: Any) -> None:
        event.synchronize()

    return wait


class VirtualBackend(DeviceBackend):
    """A CPU virtual device, with or without a modelled link.

    Example:
        >>> b = VirtualBackend(torch.device("cpu"), link_gbps=16.0)
        >>> b.async_copies, b.prefetch_depth is None
        (True, True)
    """

    is_cuda = False
    supports_pinning = False
    aliases_host = True

    @property
    def async_copies(self) -> bool:
        return self.link_gbps is not None

    @property
    def prefetch_depth(self) -> int | None:
        return None  # uploads are accounted, not copied: as early as the budget allows

    def create_streams(self, name: str, trace: Any) -> Streams:
        threaded = self.link_gbps is not None
        h2d = CopyEngine(f"{name} h2d", self.link_gbps, threaded, trace)
        d2h = CopyEngine(f"{name} d2h", self.link_gbps, threaded, trace)
        return Streams(h2d.bulk, h2d.express, NullStream(), d2h.express, d2h.bulk, h2d, d2h)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def new_event(self) -> Any:
        return CpuEvent()

    def device_scope(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def job_scope(self, compute_stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass  # compute is synchronous; the copy engines are drained by the manager

    def available_bytes(self, num_devices: int) -> float:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total / num_devices

    def _hold(self, lane: Any, kind: str, what: str, nbytes: int) -> None:
        if self.link_gbps is not None and nbytes:
            lane.hold(kind, what, nbytes)

    def to_device(
        self, dev: DeviceQueues, host_tensors: Sequence[Any], keep_requires_grad: bool
    ) -> list[Any]:
        # copies are real, so a layer mutating its input in place cannot corrupt the host copy
        # kept for recompute
        wait_arrived(host_tensors)
        staged = take_staged(dev, host_tensors)
        out = []
        nbytes = 0
        for t in host_tensors:
            if isinstance(t, torch.Tensor):
                d = t.detach().to(self.device, copy=True)
                if not any(t is s for s in staged):  # a staged one crossed the link already
                    nbytes += nbytes_of(d)
                if keep_requires_grad and t.requires_grad:
                    d.requires_grad_(True)
                out.append(d)
            else:
                out.append(t)
        dev.count_activation_upload(nbytes + sum(nbytes_of(t) for t in staged))
        self._hold(dev.upstream, "h2d", "activations", nbytes)
        return out

    def to_host(
        self, dev: DeviceQueues, device_tensors: Sequence[Any], keep_requires_grad: bool
    ) -> list[Any]:
        out = []
        nbytes = 0
        moved = []
        for t in device_tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                d = t.detach()
                nbytes += nbytes_of(d)
                d = d.requires_grad_(True) if keep_requires_grad and t.requires_grad else d
                moved.append(d)
                out.append(d)
            elif isinstance(t, torch.Tensor):
                out.append(t.detach().cpu())
            else:
                out.append(t)
        if self.link_gbps is not None and nbytes:
            # the copy crosses the modelled link in the background, as a GPU's download runs
            # beside the next microbatch's compute; whoever uploads these tensors again waits
            # for their arrival first (to_device), so no transfer is ever skipped
            arrival = dev.downstream.submit("d2h", "activations", nbytes)
            with _marks_lock:
                for d in moved:
                    _arrivals[d] = arrival
        return out

    def prefetch_to_device(self, dev: DeviceQueues, host_tensors: Sequence[Any]) -> None:
        if self.link_gbps is None:
            return
        todo = []
        for t in host_tensors:
            if not isinstance(t, torch.Tensor) or _mark(_staged, t) is not None:
                continue
            arrival = _mark(_arrivals, t)
            if arrival is not None and not arrival.query():
                continue  # still crossing to the host: to_device moves it when it is there
            todo.append(t)
        nbytes = sum(nbytes_of(t) for t in todo)
        if not nbytes:
            return
        event = dev.upstream.submit("h2d", "activations (prefetched)", nbytes)
        with _marks_lock:
            for t in todo:
                _staged[t] = (dev, event)

    def fill_stage(
        self, dev: DeviceQueues, stage: Any, copy_param: Callable[[torch.Tensor], torch.Tensor]
    ) -> Any:
        # parameters are the host tensors themselves (host memory is device memory); buffers
        # are copied, since layers update them in place (running statistics) and only a
        # forward stage may write them back
        for sk in stage.skeletons:
            for mod, name, is_param, host, _ in sk.slots:
                d = stage.host_to_dev.get(id(host))
                if d is None:
                    if is_param:
                        d = nn.Parameter(host.detach(), requires_grad=host.requires_grad)
                    else:
                        d = host.detach().clone()
                    stage.host_to_dev[id(host)] = d
                set_slot(mod, name, is_param, d)
        return None

    def after_fill(
        self, dev: DeviceQueues, stage: Any, copy_bytes: int, what: str, prefetch: bool
    ) -> Any:
        """With a link, the copy engine moves the stage layer by layer, in order, while the
        worker computes (what came before, or the stage's first layers: each layer waits for
        its own parameters, as a GPU kernel waits for the copy it reads). Returns the event of
        the last layer."""
        if self.link_gbps is None:
            return None
        seen: set[int] = set()
        last = None
        for sk in stage.skeletons:
            layer_bytes = 0
            for _, _, _, host, _ in sk.slots:
                if id(host) not in seen:
                    seen.add(id(host))
                    layer_bytes += nbytes_of(host)
            if not layer_bytes:
                continue
            last = dev.param_upstream.submit("upload", what, layer_bytes)
            module = sk.module
            # refresh() shares the host layer's hook dict with the skeleton: use a copy of it
            module._forward_pre_hooks = collections.OrderedDict(module._forward_pre_hooks)
            stage.hooks.append(module.register_forward_pre_hook(_waiter(last)))
            stage.layer_ready.append(last)
        return last

    def wait_ready(self, dev: DeviceQueues, stage: Any, ready: Any) -> None:
        # the worker thread is the compute stream; with per-layer uploads (after_fill) it waits
        # for the first layer here, the others as they are called
        (stage.layer_ready[0] if stage.layer_ready else ready).synchronize()

    def buffer_to_host(self, dev: DeviceQueues, buffer: torch.Tensor) -> torch.Tensor:
        return buffer

    def after_buffers(self, dev: DeviceQueues, what: str, nbytes: int) -> None:
        self._hold(dev.downstream, "d2h", f"buffers {what}", nbytes)

    def grads_to_host(
        self, dev: DeviceQueues, grads: list[tuple[torch.Tensor, torch.Tensor]], what: str
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._hold(dev.grad_downstream, "download", what, sum(nbytes_of(g) for _, g in grads))
        return grads

    def start_grad_download(
        self, dev: DeviceQueues, grads: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> GradLanding:
        # handed over as they are, after the modelled link time on the gradient lane
        return GradLanding(grads, None, dev.grad_downstream)
