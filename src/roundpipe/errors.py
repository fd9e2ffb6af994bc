"""RoundPipe's error family: every error it raises on purpose is a :class:`RoundPipeError`, and
keeps the standard base its callers (and the user guide) catch: ``ValueError`` for a bad value,
``TypeError`` for a wrong kind, ``RuntimeError`` for a call out of order.

This module is the ground floor: it imports nothing from RoundPipe, so every floor can raise
these (``roundpipe.devices`` up to the wrappers).

Example:
    >>> from roundpipe import RoundPipeRunConfig
    >>> try:
    ...     RoundPipeRunConfig(num_microbatch=0)
    ... except RoundPipeError as exc:
    ...     print(isinstance(exc, ValueError))
    True
"""

from __future__ import annotations

__all__ = ["RoundPipeError", "RoundPipeValueError", "RoundPipeTypeError", "RoundPipeRuntimeError"]


class RoundPipeError(Exception):
    """Base class of every error RoundPipe raises on bad input or misuse."""


class RoundPipeValueError(RoundPipeError, ValueError):
    """An argument, option or environment variable with a value RoundPipe cannot use."""


class RoundPipeTypeError(RoundPipeError, TypeError):
    """An argument of the wrong kind (a model that is not a module, a plan that is no plan...)."""


class RoundPipeRuntimeError(RoundPipeError, RuntimeError):
    """A call at a time it cannot run (before devices exist, during a pending step, ...)."""
