"""``replace``: swap a module for another one."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..exceptions import PrimitiveError, PrimitiveTypeError
from ..schedule import Primitive, Schedule, register_primitive
from ..surgery import label, move_hooks
from .subgraph_replace import replace_subgraph


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
                f'replace on "{label(sch.path)}" needs an nn.Module, got '
                f"{type(new_module).__name__}; wrap a function in an nn.Module first"
            )
        if subgraph is not None:
            return replace_subgraph(sch, new_module, subgraph, **kwargs)
        if kwargs:
            raise PrimitiveError(
                f'replace() got unexpected arguments {sorted(kwargs)} on "{sch.path}"'
            )
        if new_module is sch.mod:
            raise PrimitiveError(f'replace on "{label(sch.path)}" got the module it already has')
        move_hooks(sch.mod, new_module)
        sch.swap_module(new_module)
        return None
