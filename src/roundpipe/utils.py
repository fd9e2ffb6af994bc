"""Generic helpers shared across RoundPipe components."""

from __future__ import annotations

import inspect
import os

import torch
from torch import nn

__all__ = [
    "derive_seed",
    "get_call_location",
    "get_model_active_size",
    "get_model_size",
    "parse_bytes",
]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1024**3,
    "gib": 1024**3,
}


def get_call_location(depth: int) -> str:
    """Return ``'filename:lineno'`` of the frame ``depth`` levels above the caller.

    Example:
        >>> ":" in get_call_location(0)
        True
    """
    frame = inspect.currentframe()
    frame = frame.f_back if frame is not None else None  # depth 0: our caller
    for _ in range(depth):
        if frame is None or frame.f_back is None:
            break
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _unique(tensors):
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def get_model_size(model: nn.Module, recurse: bool = True) -> int:
    """Return the parameter + buffer bytes of ``model`` (shared tensors counted once).

    Example:
        >>> get_model_size(nn.Linear(2, 2))
        24
    """
    tensors = list(model.parameters(recurse)) + list(model.buffers(recurse))
    return sum(t.numel() * t.element_size() for t in _unique(tensors))


def get_model_active_size(model: nn.Module, recurse: bool = True) -> int:
    """Return the bytes of parameters of ``model`` that require grad.

    Example:
        >>> get_model_active_size(nn.Linear(2, 2).requires_grad_(False))
        0
    """
    params = [p for p in model.parameters(recurse) if p.requires_grad]
    return sum(p.numel() * p.element_size() for p in _unique(params))


def parse_bytes(value: int | float | str, name: str = "value") -> int:
    """Parse a byte count such as ``4096``, ``"64MiB"`` or ``"1.5G"``.

    Example:
        >>> parse_bytes("2KiB")
        2048
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a byte count, got bool")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be int or str, got {type(value).__name__}")
    text = value.strip().lower()
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num) :].strip()
    if unit not in _UNITS or not num:
        raise ValueError(f"{name}: cannot parse byte count {value!r}")
    result = int(float(num) * _UNITS[unit])
    if result <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return result


def derive_seed(base_seed: int, layer_id: int, microbatch_id: int) -> int:
    """Deterministic RNG seed for one (layer, microbatch) execution.

    RoundPipe seeds every layer call from this value when ``preserve_rng_state`` is on, so
    random ops (dropout) give the same result in forward and recompute, independently of
    how worker threads interleave.

    Example:
        >>> derive_seed(1, 2, 3) == derive_seed(1, 2, 3)
        True
    """
    # splitmix64-style mixing keeps nearby (layer, microbatch) pairs uncorrelated.
    x = (
        base_seed * 0x9E3779B97F4A7C15
        + layer_id * 0xBF58476D1CE4E5B9
        + microbatch_id * 0x94D049BB133111EB
    )
    x &= (1 << 64) - 1
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 29
    return x & ((1 << 63) - 1)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes held by the elements of ``t``."""
    return t.numel() * t.element_size()
