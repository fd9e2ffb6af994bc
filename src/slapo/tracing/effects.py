"""What a graph cannot hold: a module that assigns attributes during its call (a recurrent state
kept on the module, a counter) and custom ``torch.autograd.Function``s (export records their
forward only, so their own backward would be lost). The module doing either must stay a call of
the original module (a leaf); the traced module itself doing it cannot be traced at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Effects", "watch_effects"]

# nn.Module's own bookkeeping: assigned by torch (hooks, state dicts), not by the model's code.
_INTERNAL = {
    "training",
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
}


@dataclass
class Effects:
    """What the watched call did that a graph would not replay, by the innermost running module
    (its path relative to the traced module; ``""`` is the module itself)."""

    assigned: dict[str, list[str]] = field(default_factory=dict)  # runner -> "path.attr"
    functions: dict[str, list[str]] = field(default_factory=dict)  # runner -> Function names

    def runners(self) -> set[str]:
        """The modules that must stay calls of the original."""
        return set(self.assigned) | set(self.functions)

    def describe(self, runner: str) -> str:
        """What ``runner`` did, for messages."""
        parts = []
        if runner in self.assigned:
            parts.append("assigns " + ", ".join(sorted(set(self.assigned[runner]))))
        if runner in self.functions:
            parts.append(
                "calls the custom autograd.Function "
                + ", ".join(sorted(set(self.functions[runner])))
                + " (a graph records its forward only, not its backward)"
            )
        return " and ".join(parts)


@contextlib.contextmanager
def watch_effects(mod: nn.Module, stack: list[str]) -> Iterator[Effects]:
    """Record attribute assignments on ``mod``'s modules and custom autograd.Function calls made
    while ``mod`` runs (``stack``: the running submodules, from ``module_stack``), then put every
    module's plain attributes back as they were (a trace must not leave fake tensors behind).

    Example:
        >>> from slapo.tracing.errors import module_stack
        >>> class Counter(nn.Module):
        ...     def forward(self, x):
        ...         self.calls = 1
        ...         return x
        >>> m = Counter()
        >>> with module_stack(m) as stack, watch_effects(m, stack) as effects:
        ...     _ = m(torch.zeros(1))
        >>> effects.assigned, hasattr(m, "calls")
        ({'': ['calls']}, False)
    """
    paths = {id(m): n for n, m in mod.named_modules(remove_duplicate=False)}
    effects = Effects()
    # Taken before the call: export swaps in fake parameters while it runs the module.
    before = {id(m): _state(m) for m in mod.modules()}
    assigned: list[tuple[nn.Module, str]] = []
    set_attr = nn.Module.__setattr__
    apply = torch.autograd.Function.__dict__["apply"]

    def watched_setattr(self: nn.Module, name: str, value: Any) -> None:
        if stack and id(self) in paths and name not in _INTERNAL:
            target = f"{paths[id(self)]}.{name}".lstrip(".")
            effects.assigned.setdefault(stack[-1], []).append(target)
            assigned.append((self, name))
        set_attr(self, name, value)

    def watched_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if stack and not cls.__module__.startswith("torch."):
            effects.functions.setdefault(stack[-1], []).append(cls.__name__)
        return apply.__func__(cls, *args, **kwargs)

    nn.Module.__setattr__ = watched_setattr  # type: ignore[method-assign]
    torch.autograd.Function.apply = classmethod(watched_apply)  # type: ignore[assignment]
    try:
        yield effects
    finally:
        nn.Module.__setattr__ = set_attr  # type: ignore[method-assign]
        torch.autograd.Function.apply = apply  # type: ignore[assignment]
        for m, name in assigned:
            _restore(m, name, before[id(m)])


def _state(m: nn.Module) -> dict[str, Any]:
    """Copies of the dicts an assignment on ``m`` can change."""
    return {
        "__dict__": dict(m.__dict__),
        "_parameters": dict(m._parameters),
        "_buffers": dict(m._buffers),
        "_modules": dict(m._modules),
    }


_PLACES = ("_parameters", "_buffers", "_modules", "__dict__")


def _restore(m: nn.Module, name: str, state: dict[str, Any]) -> None:
    """Put what ``m.<name>`` was before the call back (a trace must not leave fake tensors)."""
    for where in _PLACES:
        _place(m, where).pop(name, None)
    for where in _PLACES:
        if name in state[where]:
            _place(m, where)[name] = state[where][name]
            return


def _place(m: nn.Module, where: str) -> dict[str, Any]:
    return m.__dict__ if where == "__dict__" else getattr(m, where)
