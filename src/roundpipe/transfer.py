"""Host <-> device copies of activations and layers.

A layer is uploaded into a cached *skeleton*: a copy of the module whose parameters and
buffers are meta tensors (zero bytes). Uploading fills the skeleton's slots with device
copies; freeing puts the meta tensors back, so nothing stays resident between stages.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .attribute import ParamAttribute
from .device import DeviceManager

__all__ = [
    "CHUNK_UPLOAD_SIZE",
    "PinnedUpload",
    "RegisterBackwardEvent",
    "StageOnDevice",
    "async_d2h",
    "async_h2d",
    "chunk_layer_params",
    "chunked_upload",
    "create_upload_pair",
    "download_layer",
    "upload_layers",
]

chunked_upload = True
CHUNK_UPLOAD_SIZE = 64 * 1024 * 1024


def async_h2d(
    device: DeviceManager, host_tensors: Iterable[Any], keep_requires_grad: bool = False
) -> list[Any]:
    """Copy tensors to ``device`` on its upload stream; non-tensors pass through.

    Copies are real even on CPU virtual devices, so a layer mutating its input in place
    cannot corrupt the host copy kept for recompute. The host data must be ready: every
    host buffer RoundPipe hands over was completed by :func:`async_d2h`.

    Example:
        >>> from roundpipe.device import get_devices
        >>> x = torch.ones(2)
        >>> y, tag = async_h2d(get_devices()[0], [x, "tag"])
        >>> y is x, bool((y == x).all()), tag
        (False, True, 'tag')
    """
    out = []
    with device.stream(device.upstream):
        for t in host_tensors:
            if isinstance(t, torch.Tensor):
                d = t.detach().to(device.device, non_blocking=device.is_cuda, copy=True)
                if device.is_cuda:  # allocated on the upload stream, consumed on compute
                    d.record_stream(device.compute_stream)
                if keep_requires_grad and t.requires_grad:
                    d.requires_grad_(True)
                out.append(d)
            else:
                out.append(t)
    device.mark_upload()
    if device.is_cuda:
        device.compute_stream.wait_stream(device.upstream)
    return out


def async_d2h(
    device: DeviceManager, device_tensors: Iterable[Any], keep_requires_grad: bool = False
) -> list[Any]:
    """Copy tensors to host memory (pinned on CUDA); the copies are complete on return.

    Example:
        >>> from roundpipe.device import get_devices
        >>> async_d2h(get_devices()[0], [torch.ones(2), 3])
        [tensor([1., 1.]), 3]
    """
    out = []
    if not device.is_cuda:
        for t in device_tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                d = t.detach()
                out.append(d.requires_grad_(True) if keep_requires_grad and t.requires_grad else d)
            elif isinstance(t, torch.Tensor):
                out.append(t.detach().cpu())
            else:
                out.append(t)
        return out
    device.downstream.wait_stream(device.compute_stream)
    with device.stream(device.downstream):
        for t in device_tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t.detach(), non_blocking=True)
                t.record_stream(device.downstream)
                keep = keep_requires_grad and t.requires_grad
                out.append(host.requires_grad_(True) if keep else host)
            else:
                out.append(t)
    # host buffers are read next by other devices' streams / the CPU, which do not order
    # against this download stream: finish the copies before handing them out
    device.downstream.synchronize()
    return out


def chunk_layer_params(
    tensor_pair: list[tuple[torch.Tensor, torch.Tensor]], n_chunks: int
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Greedy number partitioning of copy work into ``n_chunks`` balanced chunks.

    Example:
        >>> a, b, c = torch.empty(4), torch.empty(3), torch.empty(2)
        >>> chunks = chunk_layer_params([(a, a), (b, b), (c, c)], 2)
        >>> [sum(s.numel() for s, _ in ch) for ch in chunks]
        [4, 5]
    """
    if n_chunks < 1:
        raise ValueError(f"n_chunks must be positive, got {n_chunks}")
    chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n_chunks)]
    loads = [0] * n_chunks
    for pair in sorted(tensor_pair, key=lambda p: -p[0].numel() * p[0].element_size()):
        i = loads.index(min(loads))
        chunks[i].append(pair)
        loads[i] += pair[0].numel() * pair[0].element_size()
    return chunks


def create_upload_pair(
    tensor_pair: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Allocate the device copy of ``src`` and register the (src, dst) copy work.

    With :func:`chunk_layer_params` this stages a layer's copies in balanced chunks (the
    internal API keeps it for that; :func:`upload_layers` copies slot by slot today).

    Example:
        >>> pairs = []
        >>> dst = create_upload_pair(pairs, torch.ones(3), torch.device("cpu"))
        >>> dst.shape, len(pairs)
        (torch.Size([3]), 1)
    """
    dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    tensor_pair.append((src.detach(), dst))
    return dst


class _Skeleton:
    """A meta-tensor copy of a layer plus the slot list mapping it to host tensors."""

    def __init__(self, layer: nn.Module) -> None:
        memo: dict[int, Any] = {}
        for p in layer.parameters():
            memo[id(p)] = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
            )
        for b in layer.buffers():
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
        self.module: nn.Module = copy.deepcopy(layer, memo)
        self.slots: list[tuple[nn.Module, str, bool, torch.Tensor, torch.Tensor]] = []
        self.module_pairs = list(zip(layer.modules(), self.module.modules()))
        for (_, host_m), (_, sk_m) in zip(
            layer.named_modules(remove_duplicate=False),
            self.module.named_modules(remove_duplicate=False),
        ):
            for name, t in host_m._parameters.items():
                if t is not None:
                    self.slots.append((sk_m, name, True, t, sk_m._parameters[name]))
            for name, t in host_m._buffers.items():
                if t is not None:
                    self.slots.append((sk_m, name, False, t, sk_m._buffers[name]))

    def refresh(self) -> None:
        """Copy the host layer's non-tensor state (``training``, flags, hooks, class) over.

        The skeleton is cached across steps, so a later ``model.eval()`` or an attribute the
        user changes must reach it before each upload.
        """
        for host_m, sk_m in self.module_pairs:
            if sk_m.__class__ is not host_m.__class__:
                sk_m.__class__ = host_m.__class__
            for key, value in host_m.__dict__.items():
                if key not in _TENSOR_DICTS:
                    sk_m.__dict__[key] = value


_TENSOR_DICTS = frozenset({"_parameters", "_buffers", "_modules"})
_skeletons: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_skeleton_lock = threading.Lock()


def _skeleton(layer: nn.Module, device: DeviceManager) -> _Skeleton:
    with _skeleton_lock:  # device workers look skeletons up concurrently
        per_dev = _skeletons.setdefault(layer, {})
        sk = per_dev.get(device.id)
    if sk is None:
        sk = _Skeleton(layer)
        with _skeleton_lock:
            sk = per_dev.setdefault(device.id, sk)
    return sk


class StageOnDevice:
    """Device copies of one stage's layers, with the bytes they hold accounted on the device."""

    def __init__(
        self,
        device: DeviceManager,
        layers: list[nn.Module],
        skeletons: list[_Skeleton],
        host_to_dev: dict[int, torch.Tensor],
        nbytes: int,
    ) -> None:
        self.device = device
        self.layers = layers
        self.skeletons = skeletons
        self.host_to_dev = host_to_dev
        self.nbytes = nbytes

    def free(self) -> None:
        """Drop the device tensors (skeleton slots back to meta) and release the account."""
        for sk in self.skeletons:
            for mod, name, is_param, _, placeholder in sk.slots:
                (mod._parameters if is_param else mod._buffers)[name] = placeholder
        self.host_to_dev.clear()
        if self.nbytes:
            self.device.memory.free(self.nbytes)
            self.nbytes = 0


def upload_layers(
    layers: list[nn.Module],
    layer_attrs: list[Any],
    device: DeviceManager,
    with_grad: bool,
    what: str = "stage",
) -> StageOnDevice:
    """Copy ``layers`` to ``device``; parameters shared between them stay shared.

    With ``with_grad``, room for the gradients of trainable parameters is accounted too.
    Raises :class:`~roundpipe.device.DeviceMemoryError` if the device budget is exceeded.
    """
    skeletons = [_skeleton(layer, device) for layer in layers]
    for sk in skeletons:
        sk.refresh()
    unique: dict[int, torch.Tensor] = {}
    for sk in skeletons:
        for _, _, _, host, _ in sk.slots:
            unique[id(host)] = host
    nbytes = sum(t.numel() * t.element_size() for t in unique.values())
    if with_grad:
        nbytes += sum(
            t.numel() * t.element_size()
            for t in unique.values()
            if isinstance(t, nn.Parameter) and t.requires_grad
        )
    device.memory.allocate(nbytes, what)
    host_to_dev: dict[int, torch.Tensor] = {}
    try:
        for attr in layer_attrs:
            attr.param_lock.acquire()
        try:
            with device.stream(device.param_upstream), torch.no_grad():
                for sk in skeletons:
                    for mod, name, is_param, host, _ in sk.slots:
                        dev = host_to_dev.get(id(host))
                        if dev is None:
                            data = host.detach().to(
                                device.device, non_blocking=device.is_cuda, copy=True
                            )
                            if device.is_cuda:
                                data.record_stream(device.compute_stream)
                            dev = (
                                nn.Parameter(data, requires_grad=host.requires_grad)
                                if is_param
                                else data
                            )
                            host_to_dev[id(host)] = dev
                        (mod._parameters if is_param else mod._buffers)[name] = dev
            if device.is_cuda:  # the copy-back must not overwrite host memory mid-DMA
                device.param_upstream.synchronize()
        finally:
            for attr in layer_attrs:
                attr.param_lock.release()
        if device.is_cuda:
            device.compute_stream.wait_stream(device.param_upstream)
    except BaseException:
        device.memory.free(nbytes)
        raise
    return StageOnDevice(device, [sk.module for sk in skeletons], skeletons, host_to_dev, nbytes)


def download_layer(
    stage: StageOnDevice, device: DeviceManager, with_buffer: bool, with_grad: bool
) -> None:
    """Copy buffers (e.g. running statistics) and accumulate gradients back to the host."""
    seen: set[int] = set()
    for sk in stage.skeletons:
        for _, _, is_param, host, _ in sk.slots:
            if id(host) in seen:
                continue
            seen.add(id(host))
            dev = stage.host_to_dev[id(host)]
            if not is_param:
                if with_buffer:
                    with torch.no_grad():
                        host.copy_(dev.to("cpu"))
                continue
            if not with_grad or dev.grad is None:
                continue
            g = dev.grad.to("cpu") if device.is_cuda else dev.grad
            attr = ParamAttribute.get(host)
            with attr.grad_lock:
                if host.grad is None:
                    host.grad = g
                else:
                    host.grad.add_(g)
            dev.grad = None


class PinnedUpload(torch.autograd.Function):
    """Differentiable host -> device copy through pinned memory (pinned only for CUDA).

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> PinnedUpload.apply(x, torch.device("cpu")).sum().backward(); x.grad
        tensor([1., 1.])
    """

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, d: torch.device) -> torch.Tensor:
        if torch.device(d).type == "cuda" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(d, non_blocking=True, copy=True)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (g.to("cpu"), None)


class RegisterBackwardEvent(torch.autograd.Function):
    """Identity whose backward records ``event`` when the gradient passes through.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> RegisterBackwardEvent.apply(x, None).sum().backward(); x.grad
        tensor([1., 1.])
    """

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, event: Any) -> torch.Tensor:
        ctx.event = event
        return input.view_as(input)

    @staticmethod
    def backward(ctx: Any, grad_outputs: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.event is not None:
            ctx.event.record()
        return grad_outputs, None
