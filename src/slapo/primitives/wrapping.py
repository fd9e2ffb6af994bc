"""Wrap a module's forward without renaming anything.

Primitives such as ``checkpoint`` and ``fork_rng`` must keep parameter names (state_dict keys)
unchanged, so that a Hugging Face checkpoint still loads into the scheduled model. Instead of an
outer wrapper module, the module's class is swapped for a one-off subclass whose ``forward`` calls
the wrapper around the original one: names, ``isinstance`` checks and ``deepcopy`` all keep working.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["wrap_forward", "forward_wraps"]

ForwardWrapper = Callable[..., Any]  # (forward, *args, **kwargs) -> output


def forward_wraps(mod: nn.Module) -> tuple[str, ...]:
    """The kinds of forward wrappers applied to ``mod``, innermost first."""
    return getattr(type(mod), "_slapo_forward_wraps", ())


def wrap_forward(mod: nn.Module, kind: str, wrapper: ForwardWrapper) -> None:
    """Make ``mod(...)`` run ``wrapper(original_forward, *args, **kwargs)``.

    Hooks registered on the module keep running around the wrapped forward, as before.
    """
    base = type(mod)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return wrapper(super(wrapped, self).forward, *args, **kwargs)

    wrapped = type(
        base.__name__,
        (base,),
        {
            "forward": forward,
            "__module__": base.__module__,
            "__doc__": base.__doc__,
            "_slapo_forward_wraps": forward_wraps(mod) + (kind,),
        },
    )
    wrapped.__qualname__ = base.__qualname__
    mod.__class__ = wrapped
