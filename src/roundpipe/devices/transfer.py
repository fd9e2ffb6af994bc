"""Host <-> device copies of activations, stage parameters and gradients.

A layer is uploaded into a cached *skeleton*: a copy of the module whose parameters and
buffers are meta tensors (zero bytes). Uploading fills the skeleton's slots with device
tensors; freeing puts the meta tensors back, so nothing stays resident between stages.

Where the copies go:

* **CUDA**: stage parameters on ``param_upstream`` (large tensors in chunks of
  :data:`CHUNK_UPLOAD_SIZE`, so activation copies on ``upstream`` slip in between), activations
  on ``upstream`` / ``downstream``, gradients on ``grad_downstream`` into pinned host buffers.
  The compute stream waits for uploads by event; a gradient download completes on the device's
  d2h engine thread, which waits for its event and then accumulates into ``param.grad``.
* **CPU virtual devices**: host and device memory are the same, so a stage uses the host
  parameters in place (no copy) and hands its gradients over without a copy; activations and
  buffers (which layers may change in place) are copied. With a modelled link each transfer
  still holds its copy engine for ``bytes / bandwidth`` (:mod:`roundpipe.devices.link`): a stage
  crosses layer by layer (each layer computes once its own parameters arrived), activations
  leave for the host in the background (an upload of them waits for their arrival) and
  :func:`prefetch_h2d` moves the next microbatch's inputs ahead.

The functions here call the device's backend (:mod:`roundpipe.devices.backend`) for everything
that differs between the two.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from .attribute import ParamAttribute
from .backend import set_slot
from .device import DeviceManager
from .virtual_backend import wait_arrived

__all__ = [
    "CHUNK_UPLOAD_SIZE",
    "StageOnDevice",
    "async_d2h",
    "async_h2d",
    "chunked_upload",
    "download_layer",
    "download_layer_async",
    "prefetch_h2d",
    "upload_layers",
    "wait_arrived",
]

# split CUDA parameter uploads larger than CHUNK_UPLOAD_SIZE bytes into copies of that size
chunked_upload = True
CHUNK_UPLOAD_SIZE = 64 * 1024 * 1024


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def async_h2d(
    device: DeviceManager, host_tensors: Iterable[Any], keep_requires_grad: bool = False
) -> list[Any]:
    """Copy tensors to ``device`` on its upload stream; non-tensors pass through.

    Copies are real even on CPU virtual devices, so a layer mutating its input in place
    cannot corrupt the host copy kept for recompute. The host data must be ready: every
    host buffer RoundPipe hands over was completed by :func:`async_d2h`. On CUDA the compute
    stream waits for the copies; on CPU the copies (and their link time) are complete on return.

    Example:
        >>> from roundpipe.device import get_devices
        >>> x = torch.ones(2)
        >>> y, tag = async_h2d(get_devices()[0], [x, "tag"])
        >>> y is x, bool((y == x).all()), tag
        (False, True, 'tag')
    """
    return device.backend.to_device(device, list(host_tensors), keep_requires_grad)


def async_d2h(
    device: DeviceManager, device_tensors: Iterable[Any], keep_requires_grad: bool = False
) -> list[Any]:
    """Copy tensors to host memory (pinned on CUDA); on return the copies are complete, except
    on a virtual device with a modelled link, where they cross the link in the background and
    :func:`async_h2d` (and :meth:`DeviceManager.wait_activation_copies`) wait for their arrival.

    Example:
        >>> from roundpipe.device import get_devices
        >>> async_d2h(get_devices()[0], [torch.ones(2), 3])
        [tensor([1., 1.]), 3]
    """
    return device.backend.to_host(device, list(device_tensors), keep_requires_grad)


def prefetch_h2d(device: DeviceManager, host_tensors: Iterable[Any]) -> None:
    """Start moving host tensors that ``device`` will upload next (the next microbatch's
    stage input) across its link while it computes: the :func:`async_h2d` that later uploads
    these very tensors to ``device`` waits for this transfer instead of making its own.

    Only a CPU virtual device with a modelled link has something to start ahead (its copies
    are real either way; the link time is what moves); elsewhere, and for tensors still on
    their way to the host, this does nothing and the upload happens as before.

    Example:
        >>> from roundpipe.device import get_devices
        >>> x = torch.ones(2)
        >>> prefetch_h2d(get_devices()[0], [x])  # no link modelled: nothing to start
        >>> bool((async_h2d(get_devices()[0], [x])[0] == x).all())
        True
    """
    device.backend.prefetch_to_device(device, list(host_tensors))


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
# host layer -> skeletons not in use; a layer gets one more when two live stages hold it (a
# prefetched stage beside the running one), so concurrent stages never share slots
_skeletons: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_skeleton_lock = threading.Lock()


def _acquire_skeleton(layer: nn.Module) -> _Skeleton:
    with _skeleton_lock:  # device workers and uploaders look skeletons up concurrently
        free = _skeletons.get(layer)
        if free:
            return free.pop()
    return _Skeleton(layer)


def _release_skeleton(layer: nn.Module, sk: _Skeleton) -> None:
    with _skeleton_lock:
        _skeletons.setdefault(layer, []).append(sk)


class StageOnDevice:
    """Device copies of one stage's layers, with the bytes they hold accounted on the device.

    ``ready`` completes the upload (None: already complete): wait for it with
    :meth:`wait_ready` before computing. ``aliases_host`` says the stage uses the host
    parameters in place (CPU virtual devices): nothing may write them (the optimizer's
    copy-back) until the stage is done with them.
    """

    def __init__(
        self,
        device: DeviceManager,
        host_layers: list[nn.Module],
        skeletons: list[_Skeleton],
        nbytes: int,
        aliases_host: bool,
    ) -> None:
        self.device = device
        self.host_layers = host_layers
        self.skeletons = skeletons
        self.layers = [sk.module for sk in skeletons]
        self.host_to_dev: dict[int, torch.Tensor] = {}
        self.nbytes = nbytes
        self.aliases_host = aliases_host
        self.ready: Any = None
        self.hooks: list[Any] = []  # per-layer upload waits a backend installed (removed at free)
        self.layer_ready: list[Any] = []  # their events, in layer order
        self._lock = threading.Lock()
        self._freed = False

    def wait_ready(self) -> None:
        """Order compute after the upload: the CUDA compute stream waits for the upload event;
        on CPU the calling (worker) thread blocks until the copy engine completed it."""
        ready, self.ready = self.ready, None
        if ready is None:
            return
        self.device.backend.wait_ready(self.device, self, ready)

    def free(self) -> None:
        """Drop the device tensors (skeleton slots back to meta) and release the account."""
        with self._lock:
            if self._freed:
                return
            self._freed = True
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        self.layer_ready.clear()
        for layer, sk in zip(self.host_layers, self.skeletons):
            for mod, name, is_param, _, placeholder in sk.slots:
                set_slot(mod, name, is_param, placeholder)
            _release_skeleton(layer, sk)
        self.host_to_dev.clear()
        if self.nbytes:
            self.device.memory.free(self.nbytes)
            self.nbytes = 0


@contextlib.contextmanager
def _param_locks(layer_attrs: list[Any]) -> Iterator[None]:
    """Hold the layers' ``param_lock``: the optimizer's copy-back waits meanwhile."""
    held = []
    try:
        for attr in layer_attrs:  # always in layer order: no lock-order inversion
            attr.param_lock.acquire()
            held.append(attr)
        yield
    finally:
        for attr in held:
            attr.param_lock.release()


def _h2d_param(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Device copy of ``host`` issued on the current (upload) stream; copies larger than
    :data:`CHUNK_UPLOAD_SIZE` are split so other streams' copies can run between the pieces."""
    nbytes = _nbytes(host)
    if not (chunked_upload and nbytes > CHUNK_UPLOAD_SIZE and host.is_contiguous()):
        return host.detach().to(device, non_blocking=True, copy=True)
    data = torch.empty(host.shape, dtype=host.dtype, device=device)
    src, dst = host.detach().reshape(-1), data.view(-1)
    step = max(CHUNK_UPLOAD_SIZE // host.element_size(), 1)
    for i in range(0, src.numel(), step):
        dst[i : i + step].copy_(src[i : i + step], non_blocking=True)
    return data


def upload_layers(
    layers: list[nn.Module],
    layer_attrs: list[Any],
    device: DeviceManager,
    with_grad: bool,
    what: str = "stage",
    *,
    prefetch: bool = False,
) -> StageOnDevice | None:
    """Upload ``layers`` to ``device``; parameters shared between them stay shared.

    With ``with_grad``, room for the gradients of trainable parameters is accounted too. When
    the budget is short, gradient downloads in flight on the device land first (they free
    their stages); if it still does not fit, raises
    :class:`~roundpipe.device.DeviceMemoryError`, or returns None for a ``prefetch`` (which has
    to wait for the running stage to end). A prefetch on a CPU virtual device with a modelled
    link leaves the transfer to the copy engine; otherwise the calling thread holds the link
    until the copy is complete. Call :meth:`StageOnDevice.wait_ready` before using the stage.

    Example:
        >>> from roundpipe.attribute import make_layer_attribute
        >>> from roundpipe.device import get_devices
        >>> layer = nn.Linear(2, 2)
        >>> attr = make_layer_attribute("demo", layer, 0, None)
        >>> stage = upload_layers([layer], [attr], get_devices()[0], with_grad=False)
        >>> stage.wait_ready(); stage.layers[0](torch.ones(1, 2)).shape
        torch.Size([1, 2])
        >>> stage.free()
    """
    skeletons = [_acquire_skeleton(layer) for layer in layers]
    for sk in skeletons:
        sk.refresh()
    unique: dict[int, torch.Tensor] = {}
    for sk in skeletons:
        for _, _, _, host, _ in sk.slots:
            unique[id(host)] = host
    copy_bytes = sum(_nbytes(t) for t in unique.values())
    nbytes = copy_bytes
    if with_grad:
        nbytes += sum(
            _nbytes(t) for t in unique.values() if isinstance(t, nn.Parameter) and t.requires_grad
        )
    backend = device.backend
    stage = StageOnDevice(device, list(layers), skeletons, 0, aliases_host=backend.aliases_host)
    if not device.memory.try_allocate(nbytes):
        device.drain_downloads()  # stages still landing their gradients free their bytes
        if not device.memory.try_allocate(nbytes):
            if prefetch:
                stage.free()
                return None
            try:
                device.memory.allocate(nbytes, what)
            except BaseException:
                stage.free()
                raise
    stage.nbytes = nbytes
    try:
        with _param_locks(layer_attrs), torch.no_grad():
            # the optimizer's copy-back must not overwrite host memory mid-copy: the backend's
            # copies are complete (or need no host memory) when the locks are released
            stage.ready = backend.fill_stage(
                device, stage, lambda host: _h2d_param(host, device.device)
            )
        ready = backend.after_fill(device, stage, copy_bytes, what, prefetch)
        if ready is not None:
            stage.ready = ready
    except BaseException:
        stage.free()
        raise
    if stage.ready is not None:
        device.mark_upload(stage.ready)
    return stage


def _accumulate(host: torch.Tensor, g: torch.Tensor) -> None:
    attr = ParamAttribute.get(host)
    with attr.grad_lock:
        if host.grad is None:
            host.grad = g
        else:
            host.grad.add_(g)


def _accumulate_all(grads: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for host, g in grads:
        _accumulate(host, g)


def _collect(
    stage: StageOnDevice, device: DeviceManager, with_buffer: bool, with_grad: bool, what: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy buffers back (synchronously) and take the device gradients: (host param, grad)."""
    seen: set[int] = set()
    grads: list[tuple[torch.Tensor, torch.Tensor]] = []
    buffer_bytes = 0
    for sk in stage.skeletons:
        for _, _, is_param, host, _ in sk.slots:
            if id(host) in seen:
                continue
            seen.add(id(host))
            dev = stage.host_to_dev[id(host)]
            if not is_param:
                if with_buffer:
                    with torch.no_grad():
                        host.copy_(device.backend.buffer_to_host(device, dev))
                    buffer_bytes += _nbytes(dev)
                continue
            if with_grad and dev.grad is not None:
                grads.append((host, dev.grad))
                dev.grad = None
    device.backend.after_buffers(device, what, buffer_bytes)
    return grads


def download_layer(
    stage: StageOnDevice,
    device: DeviceManager,
    with_buffer: bool,
    with_grad: bool,
    what: str = "stage",
) -> None:
    """Copy buffers (e.g. running statistics) and accumulate gradients back to the host; the
    data is on the host on return."""
    grads = _collect(stage, device, with_buffer, with_grad, what)
    grads = device.backend.grads_to_host(device, grads, what)
    for host, g in grads:
        _accumulate(host, g)


def download_layer_async(
    stage: StageOnDevice,
    device: DeviceManager,
    with_buffer: bool,
    with_grad: bool,
    what: str,
    skip: Callable[[], bool],
    on_done: Callable[[BaseException | None], None],
) -> Any:
    """Like :func:`download_layer`, but the gradients land in the background, on the device's
    d2h copy engine: they are accumulated into ``param.grad`` (unless ``skip()``), the stage is
    freed, then ``on_done(error)`` runs, always exactly once. Buffers are copied before return.

    On CUDA the gradients copy on ``grad_downstream`` (after the compute stream's work) into
    pinned host buffers; the engine thread waits for the copy's event. On CPU virtual devices
    the gradient tensors are handed over as they are, after the modelled link time.

    Returns the transfer's :class:`~roundpipe.devices.link.CopyEvent`. If this raises, ``on_done`` has
    already run with the error.
    """
    try:
        grads = _collect(stage, device, with_buffer, with_grad, what)
        nbytes = sum(_nbytes(g) for _, g in grads)
        grads, copied, lane = device.backend.start_grad_download(device, grads)
    except BaseException as exc:
        stage.free()
        on_done(exc)
        raise

    def land() -> None:
        # every tensor reference this thread holds is dropped before on_done: once the run is
        # done the main thread may exit, and a daemon thread freeing a tensor during interpreter
        # shutdown aborts the process
        error: BaseException | None = None
        try:
            if copied is not None:
                copied.synchronize()
            if not skip():
                _accumulate_all(grads)
        except BaseException as exc:  # noqa: BLE001 - reported through on_done
            error = exc
        grads.clear()
        try:
            stage.free()
        except BaseException as exc:  # noqa: BLE001
            error = error or exc
        on_done(error)

    try:
        return lane.submit("download", what, nbytes, then=land)
    except BaseException as exc:  # the engine was shut down: land() will never run
        stage.free()
        on_done(exc)
        raise
