"""Context managers for RoundPipe.

Flags live in thread-local storage: each device worker runs its own forward / recompute
scope, and the optimizer thread its own optimizer scope.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import RoundPipeError

__all__ = [
    "ForwardCtx",
    "OptimizerCtx",
    "RecomputeCtx",
    "RecomputeDataError",
    "doing_optimizer",
    "doing_recompute",
    "flags",
    "get_recompute_data",
    "save_for_recompute",
]

flags = threading.local()
_Scope = TypeVar("_Scope", bound="_LayerScope")


def _stack(name: str) -> list:
    stack = getattr(flags, name, None)
    if stack is None:
        stack = []
        setattr(flags, name, stack)
    return stack


class _LayerScope:
    """Pushes itself on the thread's ``_STACK`` stack for the duration of a ``with`` block."""

    _STACK = ""

    def __enter__(self: _Scope) -> _Scope:
        _stack(self._STACK).append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _stack(self._STACK).pop()


class ForwardCtx(_LayerScope):
    """Marks a scope as a RoundPipe forward pass of one layer.

    ``save_for_recompute`` receives whatever the layer passes to the module-level
    :func:`save_for_recompute`; RoundPipe hands it back during recompute.
    """

    _STACK = "forward"

    def __init__(self, save_for_recompute: Callable[..., None]) -> None:
        self.save_for_recompute = save_for_recompute


class RecomputeCtx(_LayerScope):
    """Marks a scope as a RoundPipe recompute of one layer, carrying its saved data."""

    _STACK = "recompute"

    def __init__(self, recompute_data: Any) -> None:
        self.recompute_data = recompute_data


class OptimizerCtx:
    """Scope in which RoundPipe models return optimizer parameters from ``parameters()``.

    Example:
        >>> import torch
        >>> from roundpipe import OptimizerCtx
        >>> with OptimizerCtx():
        ...     assert doing_optimizer()
    """

    def __enter__(self) -> OptimizerCtx:
        flags.optimizer_depth = getattr(flags, "optimizer_depth", 0) + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        flags.optimizer_depth -= 1


def doing_optimizer() -> bool:
    """Whether the current thread is inside an :class:`OptimizerCtx`."""
    return getattr(flags, "optimizer_depth", 0) > 0


def doing_recompute() -> bool:
    """Whether the current thread is recomputing a layer for backward.

    Example:
        >>> doing_recompute()
        False
    """
    return bool(_stack("recompute"))


class RecomputeDataError(RoundPipeError, AssertionError, RuntimeError):
    """:func:`get_recompute_data` called where there is nothing to get.

    An ``AssertionError``, as the user guide documents, and a ``RuntimeError``, as this
    package documented it before: ``except`` clauses written for either keep working.
    """


def get_recompute_data() -> tuple:
    """Data the layer saved with :func:`save_for_recompute` in forward, always as a tuple.

    Raises:
        RecomputeDataError: (an ``AssertionError`` and a ``RuntimeError``) if called outside a
            recompute (check :func:`doing_recompute` first), or if the layer's forward saved
            nothing.

    Example:
        >>> try:
        ...     get_recompute_data()
        ... except AssertionError as err:
        ...     print(type(err).__name__, isinstance(err, RuntimeError))
        RecomputeDataError True
    """
    stack = _stack("recompute")
    if not stack:
        raise RecomputeDataError(
            "get_recompute_data() called outside a RoundPipe recompute; call it only when "
            "doing_recompute() is True"
        )
    data = stack[-1].recompute_data
    if data is None:
        raise RecomputeDataError(
            "get_recompute_data(): this layer saved nothing with save_for_recompute() in its "
            "forward; call save_for_recompute(...) there whenever doing_recompute() is False"
        )
    return tuple(data)


def save_for_recompute(*data: Any) -> None:
    """Save data (no tensors requiring grad) to be handed back during recompute.

    At most once per layer call. A no-op outside a RoundPipe forward that stores state
    for backward (inference, or plain PyTorch execution).

    Example:
        >>> save_for_recompute(1, 2)  # outside RoundPipe: no-op
    """
    stack = _stack("forward")
    if stack:
        stack[-1].save_for_recompute(*data)
