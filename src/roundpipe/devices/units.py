"""Byte counts: sizes given as text (``"2GiB"``) and the bytes a tensor holds."""

from __future__ import annotations

import torch

from ..errors import RoundPipeTypeError, RoundPipeValueError

__all__ = ["parse_bytes", "tensor_bytes"]

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


def parse_bytes(value: int | float | str, name: str = "value") -> int:
    """Parse a byte count such as ``4096``, ``"64MiB"`` or ``"1.5G"``.

    Example:
        >>> parse_bytes("2KiB")
        2048
    """
    if isinstance(value, bool):
        raise RoundPipeTypeError(f"{name} must be a byte count, got bool")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise RoundPipeValueError(f"{name} must be positive, got {value}")
        return int(value)
    if not isinstance(value, str):
        raise RoundPipeTypeError(f"{name} must be int or str, got {type(value).__name__}")
    text = value.strip().lower()
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num) :].strip()
    if unit not in _UNITS or not num:
        raise RoundPipeValueError(f"{name}: cannot parse byte count {value!r}")
    result = int(float(num) * _UNITS[unit])
    if result <= 0:
        raise RoundPipeValueError(f"{name} must be positive, got {value!r}")
    return result


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes held by the elements of ``t``."""
    return t.numel() * t.element_size()
