"""CPU memory helpers: page-lock model storage so device copies can run asynchronously."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import RoundPipeRuntimeError, RoundPipeValueError

__all__ = ["pin_module_alloc", "pin_module_register", "pin_module"]

_registered: list[torch.Tensor] = []  # keeps cudaHostRegister'ed storages alive


def _tensors(mod: nn.Module) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in list(mod.parameters()) + list(mod.buffers()):
        if id(t) not in seen and t.device.type == "cpu":
            seen.add(id(t))
            out.append(t)
    return out


def pin_module_alloc(mod: nn.Module) -> None:
    """Move parameters and buffers into freshly allocated pinned memory (needs CUDA).

    Shared parameters stay shared because the tensor objects are updated in place.
    """
    if not torch.cuda.is_available():
        raise RoundPipeRuntimeError(
            "pin_model='alloc' needs CUDA; use pin_model='off' on CPU-only machines"
        )
    for t in _tensors(mod):
        if not t.is_pinned():
            t.data = t.data.pin_memory()


def pin_module_register(mod: nn.Module) -> None:
    """Page-lock existing parameter / buffer storage in place with ``cudaHostRegister``.

    Avoids the power-of-two padding of the pinned allocator (less host memory) at some
    transfer speed cost.
    """
    if not torch.cuda.is_available():
        raise RoundPipeRuntimeError(
            "pin_model='register' needs CUDA; use pin_model='off' on CPU-only machines"
        )
    cudart = torch.cuda.cudart()
    for t in _tensors(mod):
        if t.is_pinned():
            continue
        if not t.is_contiguous():
            t.data = t.data.contiguous()
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        err = cudart.cudaHostRegister(storage.data_ptr(), storage.nbytes(), 0)
        if int(err) != 0:
            raise RoundPipeRuntimeError(f"cudaHostRegister failed with error {int(err)}")
        _registered.append(t.data)


def pin_module(mod: nn.Module, how: str, device_supports_pinning: bool) -> None:
    """Pin ``mod`` according to ``how`` (``"alloc"``, ``"register"`` or ``"off"``).

    Pinning only helps devices with asynchronous copies (CUDA); elsewhere it is skipped.
    """
    if how not in ("alloc", "register", "off"):
        raise RoundPipeValueError(f"pin_model must be 'alloc', 'register' or 'off', got {how!r}")
    if how == "off" or not device_supports_pinning:
        return
    if how == "alloc":
        pin_module_alloc(mod)
    else:
        pin_module_register(mod)
