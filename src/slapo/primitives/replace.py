"""``replace``: swap a module for another one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from ..exceptions import PrimitiveError, PrimitiveTypeError
from .base import Primitive, register_primitive

if TYPE_CHECKING:
    from ..schedule import Schedule

# The hook dictionaries a module carries; replace moves them to the new module so that hooks the
# user (or a sync primitive) registered keep firing.
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def _move_hooks(old: nn.Module, new: nn.Module) -> None:
    for attr in _HOOK_DICTS:
        src = getattr(old, attr, None)
        dst = getattr(new, attr, None)
        if src and dst is not None:
            for key, hook in src.items():
                dst.setdefault(key, hook)
    if getattr(old, "_is_full_backward_hook", None) is not None:
        new._is_full_backward_hook = old._is_full_backward_hook


@register_primitive()
class ReplacePrimitive(Primitive):
    """Replace the module with ``new_module`` (or, after ``trace``, a subgraph with it).

    The module's forward hooks move to the new module, and the child schedules are rebuilt from
    the new module's children. The new module keeps its own parameter names: give it the same
    attribute names as the old one if a checkpoint must still load.

    Example:
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
        >>> sch["1"].replace(nn.ReLU())
    """

    name = "replace"

    @staticmethod
    def apply(sch: Schedule, new_module: nn.Module, subgraph: Any = None, **kwargs: Any) -> None:
        if not isinstance(new_module, nn.Module):
            raise PrimitiveTypeError(
                f'replace on "{sch.path or "<root>"}" needs an nn.Module, got '
                f"{type(new_module).__name__}; wrap a function in an nn.Module first"
            )
        if subgraph is not None:
            return _replace_subgraph(sch, new_module, subgraph, **kwargs)
        if kwargs:
            raise PrimitiveError(
                f'replace() got unexpected arguments {sorted(kwargs)} on "{sch.path}"'
            )
        if new_module is sch.mod:
            raise PrimitiveError(
                f'replace on "{sch.path or "<root>"}" got the module it already has'
            )
        _move_hooks(sch.mod, new_module)
        sch.swap_module(new_module)
        return None


def _replace_subgraph(sch: Schedule, new_module: nn.Module, subgraph: Any, **kwargs: Any) -> Any:
    """Replace a traced subgraph; provided by the static-graph primitives."""
    from . import subgraph_replace  # noqa: F401  (registers the implementation)

    return subgraph_replace.replace_subgraph(sch, new_module, subgraph, **kwargs)
