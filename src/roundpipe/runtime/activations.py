"""Activation memory accounting on CPU virtual devices.

A CPU virtual device shares the host's memory and allocator, so nothing measures what a stage
holds besides its parameters (which :func:`~roundpipe.devices.transfer.upload_layers` accounts).
With ``ROUNDPIPE_ACCOUNT_ACTIVATIONS=1`` every stage job on a virtual device also accounts, on
the device's :class:`~roundpipe.devices.device.MemoryAccount`, the bytes of every tensor storage
its compute creates (a ``TorchDispatchMode`` sees each op's outputs: activations, uploaded
inputs, autograd's saved tensors and gradients), until the storage is freed or handed to the
host (:meth:`ActivationAccount.release`: a layer input saved for backward, a stage output). The
device's ``peak`` then is parameters + gradients + activations, what a GPU's allocator would
hold, and a budget (``ROUNDPIPE_DEVICE_MEMORY``) is enforced on all of it.

Only storages created inside the job count; buffers a kernel allocates and frees internally
(workspaces) do not. CUDA devices have a real allocator: use ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ActivationAccount", "LiveBytes", "accounting_enabled"]

ENV_VAR = "ROUNDPIPE_ACCOUNT_ACTIVATIONS"


def accounting_enabled() -> bool:
    """Whether ``ROUNDPIPE_ACCOUNT_ACTIVATIONS`` asks for activation accounting.

    Example:
        >>> import os
        >>> os.environ.pop("ROUNDPIPE_ACCOUNT_ACTIVATIONS", None) and None
        >>> accounting_enabled()
        False
    """
    return os.environ.get(ENV_VAR, "0").strip().lower() in ("1", "true", "yes", "on")


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created by ops while the mode is entered, counted until
    each storage is freed (or :meth:`release` d); ``peak`` is the most counted at once.

    Each storage counts once however many views share it. Storages that existed before can be
    added with :meth:`track` (e.g. a model's parameters). Thread-safe: storages may die on any
    thread.

    Example:
        >>> live = LiveBytes()
        >>> with live:
        ...     a = torch.ones(256)          # 1 KiB
        ...     b = a * 2                    # 1 KiB more
        ...     del a
        >>> live.peak, live.now
        (2048, 1024)
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0
        # id(storage) -> (bytes, finalizer); the storage's Python object lives as long as the
        # storage itself, so the id stays unique while it is counted
        self._alive: dict[int, tuple[int, Any]] = {}
        self._lock = threading.RLock()  # a finalizer may run while it is held

    # -- counting ---------------------------------------------------------------------------
    def _add(self, nbytes: int) -> None:
        """Account ``nbytes`` more (a subclass may refuse by raising)."""
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def _sub(self, nbytes: int) -> None:
        self.now -= nbytes

    def _freed(self, key: int) -> None:
        with self._lock:
            entry = self._alive.pop(key, None)
            if entry is not None:
                self._sub(entry[0])

    def track(self, tensors: Iterable[Any]) -> None:
        """Count the storages of ``tensors`` (non-tensors and meta tensors are skipped)."""
        for t in tensors:
            if _storage_key(t) is None:
                continue
            st = t.untyped_storage()
            nbytes = st.nbytes()
            if not nbytes:
                continue
            key = id(st)
            with self._lock:
                if key in self._alive:
                    continue
                self._add(nbytes)
                self._alive[key] = (nbytes, weakref.finalize(st, self._freed, key))

    def release(self, tensors: Iterable[Any]) -> None:
        """Stop counting the storages of ``tensors`` (they moved to the host)."""
        for t in tensors:
            key = _storage_key(t)
            if key is None:
                continue
            with self._lock:
                entry = self._alive.pop(key, None)
                if entry is not None:
                    entry[1].detach()
                    self._sub(entry[0])

    def release_all(self) -> None:
        """Stop counting everything still counted."""
        with self._lock:
            entries, self._alive = list(self._alive.values()), {}
            for nbytes, fin in entries:
                fin.detach()
                self._sub(nbytes)

    def reset_peak(self) -> None:
        """Start the peak over from the bytes counted now."""
        with self._lock:
            self.peak = self.now

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # views and in-place ops return storages of their inputs: those are counted already
        # (or, like a parameter's, are not this mode's to count)
        inputs = {_storage_key(t) for t in pytree.tree_leaves((args, kwargs))}
        self.track(t for t in pytree.tree_leaves(out) if _storage_key(t) not in inputs)
        return out


def _storage_key(t: Any) -> int | None:
    """``id`` of a plain tensor's storage (its Python object lives as long as the storage);
    None for non-tensors, meta tensors and wrapper subclasses without a storage of their own."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    try:
        return id(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


class ActivationAccount(LiveBytes):
    """:class:`LiveBytes` that accounts on a device's ``MemoryAccount`` (``memory``): its
    ``resident`` and ``peak`` grow with the activations, and overflowing its budget raises
    :class:`~roundpipe.devices.device.DeviceMemoryError` from the op that allocated.

    Example:
        >>> from roundpipe.devices.device import MemoryAccount
        >>> acc = MemoryAccount("dev0", budget=None)
        >>> with ActivationAccount(acc, "stage") as act:
        ...     x = torch.ones(256)
        ...     act.release([x])             # handed to the host
        >>> acc.peak, acc.resident
        (1024, 0)
    """

    def __init__(self, memory: Any, what: str) -> None:
        super().__init__()
        self.memory = memory
        self.what = what

    def _add(self, nbytes: int) -> None:
        self.memory.allocate(nbytes, f"{self.what} (activations)")
        super()._add(nbytes)

    def _sub(self, nbytes: int) -> None:
        self.memory.free(nbytes)
        super()._sub(nbytes)
