"""One interface for the devices RoundPipe streams layers to.

A :class:`~roundpipe.devices.device.DeviceManager` owns threads, a job queue and a memory
account; *how* it moves data and orders work is its backend's business:

* :class:`~roundpipe.devices.cuda_backend.CudaBackend`: a GPU. Streams and CUDA events order the
  copies and the compute; host buffers are pinned so copies run asynchronously; stage parameters
  are real device copies.
* :class:`~roundpipe.devices.virtual_backend.VirtualBackend`: a CPU *virtual* device. Host memory
  is device memory: stage parameters are used in place, activations are copied; two copy engines
  (:mod:`roundpipe.devices.link`) stand in for the copy streams and, with a modelled link, make
  every transfer take ``bytes / bandwidth`` beside the compute.

Code above the devices (:mod:`roundpipe.devices.transfer`, the runtime) calls the backend instead
of asking which kind of device it has.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from .link import CopyEngine, CopyLane


class DeviceQueues(Protocol):
    """What a backend reads from the device it serves
    (:class:`~roundpipe.devices.device.DeviceManager`): the queues :meth:`DeviceBackend.
    create_streams` made, and where it counts uploaded activations."""

    param_upstream: Any
    upstream: Any
    compute_stream: Any
    downstream: Any
    grad_downstream: Any
    d2h: Any

    def count_activation_upload(self, nbytes: int) -> None: ...


__all__ = ["DeviceBackend", "DeviceQueues", "GradLanding", "Streams", "set_slot"]


def set_slot(mod: nn.Module, name: str, is_param: bool, value: torch.Tensor) -> None:
    """Put ``value`` into the parameter or buffer slot ``name`` of ``mod`` (no checks)."""
    (mod._parameters if is_param else mod._buffers)[name] = value


def nbytes_of(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


class Streams(NamedTuple):
    """The ordered queues of one device: stage parameters up, activations up, compute,
    activations down, gradients down; and the copy engines behind them (``h2d`` may be None
    where copies are issued on the streams themselves)."""

    param_upstream: Any
    upstream: Any
    compute_stream: Any
    downstream: Any
    grad_downstream: Any
    h2d: CopyEngine | None
    d2h: CopyEngine


class GradLanding(NamedTuple):
    """A gradient download in flight: ``grads`` (host parameter, host-side gradient) land once
    ``copied`` (an event, None: nothing to wait for) completed; ``lane`` is the d2h lane that
    lands them in order."""

    grads: list[tuple[torch.Tensor, torch.Tensor]]
    copied: Any
    lane: CopyLane


class DeviceBackend(abc.ABC):
    """How one kind of device orders work and moves data between host and device memory.

    Attributes:
        device: the torch device.
        link_gbps: the modelled link of a virtual device (GB/s), None elsewhere.
        is_cuda: whether the device is a GPU (its work is asynchronous to the host thread).
        supports_pinning: whether pinned host memory speeds up its copies.
        aliases_host: whether a stage uses the host parameters in place (no copy): nothing
            may write them (the optimizer's copy-back) until the stage is done with them.
        async_copies: whether copies run beside compute (a next stage can be prefetched).
        prefetch_depth: how many queued stages may be uploaded ahead of the running one
            (None: as many as the memory budget holds).

    Example:
        >>> from roundpipe.devices.virtual_backend import VirtualBackend
        >>> backend = VirtualBackend(torch.device("cpu"))
        >>> isinstance(backend, DeviceBackend), backend.aliases_host, backend.async_copies
        (True, True, False)
    """

    is_cuda: bool = False
    supports_pinning: bool = False
    aliases_host: bool = False

    def __init__(self, device: torch.device, link_gbps: float | None = None) -> None:
        self.device = device
        self.link_gbps = link_gbps

    @property
    @abc.abstractmethod
    def async_copies(self) -> bool:
        """Whether copies run beside compute."""

    @property
    def prefetch_depth(self) -> int | None:
        """Stages a device may upload ahead of the running one (None: as memory allows)."""
        return 1

    # -- streams, events, scopes ----------------------------------------------------------
    @abc.abstractmethod
    def create_streams(self, name: str, trace: Any) -> Streams:
        """Create the device's streams / copy engines (``trace`` receives transfer spans)."""

    @abc.abstractmethod
    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context that makes ``stream`` current."""

    @abc.abstractmethod
    def new_event(self) -> Any:
        """A fresh event (complete until recorded on a stream or lane)."""

    @abc.abstractmethod
    def device_scope(self) -> contextlib.AbstractContextManager:
        """Context that makes this device current (for the uploader thread)."""

    @abc.abstractmethod
    def job_scope(self, compute_stream: Any) -> contextlib.AbstractContextManager:
        """Context a stage job computes in (device current, compute stream current)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until the device's own queued work (kernels) is complete."""

    @abc.abstractmethod
    def available_bytes(self, num_devices: int) -> float:
        """Memory available to RoundPipe on this device when no budget is set."""

    # -- activations --------------------------------------------------------------------------
    @abc.abstractmethod
    def to_device(
        self, dev: DeviceQueues, host_tensors: Sequence[Any], keep_requires_grad: bool
    ) -> list[Any]:
        """Copy tensors to the device (non-tensors pass through); compute may use them on
        return (a GPU's compute stream waits for the copies)."""

    @abc.abstractmethod
    def to_host(
        self, dev: DeviceQueues, device_tensors: Sequence[Any], keep_requires_grad: bool
    ) -> list[Any]:
        """Copy tensors to host memory for other devices and the host to read."""

    def prefetch_to_device(self, dev: DeviceQueues, host_tensors: Sequence[Any]) -> None:  # noqa: B027
        """Start moving host tensors the device uploads next (default: nothing to start)."""

    # -- stage parameters ---------------------------------------------------------------------
    @abc.abstractmethod
    def fill_stage(
        self, dev: DeviceQueues, stage: Any, copy_param: Callable[[torch.Tensor], torch.Tensor]
    ) -> Any:
        """Fill the stage's skeleton slots with device tensors; runs while the layers'
        parameter locks are held. ``copy_param`` makes a device copy of one host tensor.
        Returns the event completing the upload (None: complete)."""

    def after_fill(  # noqa: B027
        self, dev: DeviceQueues, stage: Any, copy_bytes: int, what: str, prefetch: bool
    ) -> Any:
        """After the parameter locks are released: the transfer's remaining work (a modelled
        link's time). Returns a new completion event, or None for no change. ``prefetch``: the
        stage is uploaded ahead of its job (on the uploader thread)."""

    @abc.abstractmethod
    def wait_ready(self, dev: DeviceQueues, stage: Any, ready: Any) -> None:
        """Order the device's compute after the upload of ``stage`` (completed by ``ready``)."""

    @abc.abstractmethod
    def buffer_to_host(self, dev: DeviceQueues, buffer: torch.Tensor) -> torch.Tensor:
        """A host-readable value of a device buffer (for ``host.copy_``)."""

    def after_buffers(self, dev: DeviceQueues, what: str, nbytes: int) -> None:  # noqa: B027
        """The buffers of a stage (``nbytes``) were copied back to the host."""

    @abc.abstractmethod
    def grads_to_host(
        self, dev: DeviceQueues, grads: list[tuple[torch.Tensor, torch.Tensor]], what: str
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Gradients on the host now: (host parameter, host gradient)."""

    @abc.abstractmethod
    def start_grad_download(
        self, dev: DeviceQueues, grads: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> GradLanding:
        """Start copying gradients to the host in the background."""
