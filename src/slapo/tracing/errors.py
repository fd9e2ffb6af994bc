"""Errors of graph capture, and naming the model code where a trace failed."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import NoReturn

from torch import nn

from ..exceptions import SlapoError
from ..surgery import label

__all__ = [
    "LeafError",
    "TraceEquivalenceError",
    "TraceError",
    "TraceSignatureError",
    "module_stack",
    "raise_trace_error",
]


class TraceError(SlapoError, RuntimeError):
    """A module could not be captured as a static graph."""


class LeafError(TraceError, ValueError):
    """A ``leaves=`` entry that names no submodule of the traced module, or is not a name."""


class TraceSignatureError(TraceError, ValueError):
    """A traced graph called with inputs it was not traced for (another size of a dimension the
    graph fixed, an optional argument given that was None, another value of a constant)."""


class TraceEquivalenceError(TraceError):
    """A module whose graph would not compute what the module does (e.g. it updates its own
    state during the call): trace() refuses it rather than return a graph that differs."""


@contextlib.contextmanager
def module_stack(mod: nn.Module) -> Iterator[list[str]]:
    """Track which submodules are running, to name the innermost one when tracing fails.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> with module_stack(model) as stack:
        ...     pass
        >>> stack
        []
    """
    stack: list[str] = []
    handles = []
    for name, sub in mod.named_modules():
        handles.append(sub.register_forward_pre_hook(lambda m, a, n=name: stack.append(n)))
        handles.append(sub.register_forward_hook(lambda m, a, o: _pop(stack)))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


def _pop(stack: list[str]) -> None:
    # A forward hook must return None, or it would replace the module's output.
    if stack:
        stack.pop()


def _where(exc: BaseException) -> str:
    """The innermost frame of model code (not torch's) where ``exc`` was raised."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if "/torch/" not in f.filename and "/slapo/" not in f.filename
    ]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename.rsplit('/', 2)[-1]}:{f.lineno} `{(f.line or '').strip()}`"


def raise_trace_error(
    path: str, mod: nn.Module, tracer: str, exc: BaseException, inner: str
) -> NoReturn:
    """Raise a :class:`TraceError` for ``exc`` that names the module, the failing submodule
    ``inner`` (if known) and the model line, with what to try instead."""
    msg = str(exc).strip().splitlines()
    first = msg[0] if msg else type(exc).__name__
    hint = (
        f' The failure is inside submodule "{inner}": trace with tracer="fx", '
        f'leaves=["{inner}"] to keep it as a call, or trace its parent only.'
        if inner
        else " Mark the submodules that cannot be traced as leaves (tracer='fx', leaves=[...])."
    )
    if tracer == "fx" and "co_varnames" in first:
        hint = (
            " fx cannot trace a forward that takes **kwargs (as transformers 5 layers do); "
            "use tracer='export', or pass concrete_args."
        )
    elif tracer == "fx":
        hint += " torch.export (tracer='export') handles data-dependent Python that fx cannot."
    raise TraceError(
        f'cannot trace "{label(path)}" ({type(mod).__name__}) with {tracer}: '
        f"{type(exc).__name__}: {first}{_where(exc)}.{hint}"
    ) from exc
