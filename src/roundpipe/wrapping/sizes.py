"""Sizes of a model's parameters and buffers, and where a call came from (the seed's
``roundpipe.utils``)."""

from __future__ import annotations

import inspect
import os

from torch import nn

__all__ = ["get_call_location", "get_model_active_size", "get_model_size"]


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
