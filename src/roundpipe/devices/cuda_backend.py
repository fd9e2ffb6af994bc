"""The GPU backend: CUDA streams and events order copies and compute; pinned host buffers make
copies asynchronous; stage parameters are real device copies (see
:class:`~roundpipe.devices.backend.DeviceBackend`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import RoundPipeValueError
from .backend import DeviceBackend, DeviceQueues, GradLanding, Streams, set_slot
from .link import CopyEngine

__all__ = ["CudaBackend"]


class CudaBackend(DeviceBackend):
    """One GPU: streams ``param_upstream``, ``upstream``, ``compute_stream``, ``downstream`` and
    ``grad_downstream``; a d2h engine thread lands gradient downloads once their event completed.

    Example:
        >>> if torch.cuda.is_available():
        ...     assert CudaBackend(torch.device("cuda", 0)).async_copies
    """

    is_cuda = True
    supports_pinning = True
    aliases_host = False

    def __init__(self, device: torch.device, link_gbps: float | None = None) -> None:
        if link_gbps is not None:
            raise RoundPipeValueError(
                "the link model is for CPU virtual devices; a GPU has a real link"
            )
        super().__init__(device, None)

    @property
    def async_copies(self) -> bool:
        return True

    @property
    def prefetch_depth(self) -> int | None:
        return 1  # GPU memory is real and unbudgeted by default: one stage ahead

    def create_streams(self, name: str, trace: Any) -> Streams:
        with torch.cuda.device(self.device):
            streams = [torch.cuda.Stream(self.device) for _ in range(5)]
        # gradient downloads land on the host (accumulated, device copies freed) on this
        # engine's thread once their event completed, while the worker computes on
        d2h = CopyEngine(f"{name} d2h", threaded=True, trace=trace)
        return Streams(*streams, None, d2h)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def device_scope(self) -> contextlib.AbstractContextManager:
        return torch.cuda.device(self.device)

    def job_scope(self, compute_stream: Any) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(compute_stream))
        return stack

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def available_bytes(self, num_devices: int) -> float:
        free, _ = torch.cuda.mem_get_info(self.device)
        return float(free)

    def to_device(
        self, dev: DeviceQueues, host_tensors: Sequence[Any], keep_requires_grad: bool
    ) -> list[Any]:
        out = []
        with torch.cuda.stream(dev.upstream):
            for t in host_tensors:
                if isinstance(t, torch.Tensor):
                    d = t.detach().to(self.device, non_blocking=True, copy=True)
                    d.record_stream(dev.compute_stream)  # allocated on upload, used on compute
                    if keep_requires_grad and t.requires_grad:
                        d.requires_grad_(True)
                    out.append(d)
                else:
                    out.append(t)
        dev.compute_stream.wait_stream(dev.upstream)
        return out

    def to_host(
        self, dev: DeviceQueues, device_tensors: Sequence[Any], keep_requires_grad: bool
    ) -> list[Any]:
        out = []
        dev.downstream.wait_stream(dev.compute_stream)
        with torch.cuda.stream(dev.downstream):
            for t in device_tensors:
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    host.copy_(t.detach(), non_blocking=True)
                    t.record_stream(dev.downstream)
                    keep = keep_requires_grad and t.requires_grad
                    out.append(host.requires_grad_(True) if keep else host)
                else:
                    out.append(t)
        # host buffers are read next by other devices' streams / the CPU, which do not order
        # against this download stream: finish the copies before handing them out
        dev.downstream.synchronize()
        return out

    def fill_stage(
        self, dev: DeviceQueues, stage: Any, copy_param: Callable[[torch.Tensor], torch.Tensor]
    ) -> Any:
        with torch.cuda.device(self.device), torch.cuda.stream(dev.param_upstream):
            for sk in stage.skeletons:
                for mod, name, is_param, host, _ in sk.slots:
                    d = stage.host_to_dev.get(id(host))
                    if d is None:
                        data = copy_param(host)
                        # allocated on the upload stream, used (and freed after) on compute
                        data.record_stream(dev.compute_stream)
                        d = (
                            nn.Parameter(data, requires_grad=host.requires_grad)
                            if is_param
                            else data
                        )
                        stage.host_to_dev[id(host)] = d
                    set_slot(mod, name, is_param, d)
            ready = torch.cuda.Event()
            ready.record(dev.param_upstream)
        # the optimizer's copy-back must not overwrite host memory mid-DMA: the copies complete
        # before the layers' param_lock is released (on the uploader thread this waits beside
        # the computing worker)
        ready.synchronize()
        return ready

    def wait_ready(self, dev: DeviceQueues, stage: Any, ready: Any) -> None:
        dev.compute_stream.wait_event(ready)

    def buffer_to_host(self, dev: DeviceQueues, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.to("cpu")

    def grads_to_host(
        self, dev: DeviceQueues, grads: list[tuple[torch.Tensor, torch.Tensor]], what: str
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(host, g.to("cpu")) for host, g in grads]

    def start_grad_download(
        self, dev: DeviceQueues, grads: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> GradLanding:
        dev.grad_downstream.wait_stream(dev.compute_stream)
        with torch.cuda.device(self.device), torch.cuda.stream(dev.grad_downstream):
            landing = []
            for host, g in grads:
                buf = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                buf.copy_(g, non_blocking=True)
                g.record_stream(dev.grad_downstream)  # freed while the copy may run
                landing.append((host, buf))
            copied = torch.cuda.Event()
            copied.record(dev.grad_downstream)
        return GradLanding(landing, copied, dev.d2h.bulk)
