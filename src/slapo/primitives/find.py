"""``find``: match module calls by name, or subgraphs by a pattern, in a traced module."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

from torch import fx, nn

from ..exceptions import PrimitiveError
from ..pattern import Pattern, Subgraph, find_call_modules, find_pattern
from ..schedule import Primitive, Schedule, register_primitive
from ..surgery import join_path, label
from .trace import traced_by_need


def traced_module(sch: Schedule, primitive: str) -> fx.GraphModule:
    """The schedule's module as a traced ``GraphModule``, traced now if it is not yet."""
    return traced_by_need(sch, primitive)


@register_primitive()
class FindPrimitive(Primitive):
    """Find module calls (a regex on their names) or subgraphs (a pattern) in the traced module.

    A string is a regex matched against the called submodule's name (its last part, or its full
    dotted name), as Slapo matched it, with ``re.match``: from the start of the name (``r"fc"``
    finds ``fc1`` and ``fc2``; ``r"fc1$"`` only ``fc1``), or its whole class name (``"ReLU"``);
    in a module traced with ``tracer="dynamo"``, dynamo's name of a call (``self_query``) too.
    A function, a ``Pattern`` instance or class, or a ``ModulePattern`` is matched structurally;
    ``call_module(regex, *args)`` inside a pattern matches a submodule call, and a ``Pattern``'s
    own submodules match calls of modules of their type. A pattern that returns a tuple (branches, e.g. q/k/v projections of one input) gives
    matches with several ``outputs``; ``sch.get_module(node.target)`` gives a matched module.
    Traced submodules (child GraphModules) are searched too; each ``Subgraph`` records the path
    of the graph it lives in. Returns a list with every non-overlapping match (empty if none);
    a match is a sequence of ``(path, node)`` pairs, as in Slapo (``subgraphs[0][0][1]`` is the
    first node of the first match), and also has ``nodes``, ``inputs`` and ``output``.
    An untraced module is traced first (trace by need: only this module, as ``trace()`` does).

    Example:
        >>> import slapo, torch
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
        >>> subgraphs = sch.find(lambda x: torch.nn.functional.gelu(x))  # traces sch by need
        >>> subgraphs, subgraphs[0][0][1].target
        ([Subgraph(path='', nodes=[_1])], '1')
    """

    name = "find"

    @staticmethod
    def apply(sch: Schedule, regex_or_pattern_fn: str | Callable | nn.Module) -> list[Subgraph]:
        traced_module(sch, "find")
        pattern: Any = regex_or_pattern_fn
        if inspect.isclass(pattern) and issubclass(pattern, nn.Module):
            pattern = pattern()
        if not isinstance(pattern, str | nn.Module) and not callable(pattern):
            raise PrimitiveError(
                f"find() takes a regex string, a pattern function or a Pattern, got {pattern!r}"
            )
        found: list[Subgraph] = []
        try:
            for rel, sub in _graph_schedules(sch):
                if isinstance(pattern, str):
                    found += find_call_modules(sub.mod, pattern, rel)
                else:
                    found += find_pattern(sub.mod, pattern, rel)
        except re.error as exc:  # a name regex: the string, call_module's or ModulePattern's
            raise PrimitiveError(
                f'find on "{label(sch.path)}": {exc.pattern!r} is not a valid regular '
                f"expression ({exc}); fix it, or match a name literally with re.escape(name)"
            ) from exc
        return found


def _graph_schedules(sch: Schedule, prefix: str = "") -> list[tuple[str, Schedule]]:
    """This schedule and every descendant whose module is a GraphModule, pre-order."""
    out = [(prefix, sch)]
    for name, child in sch.child.items():
        if isinstance(child.mod, fx.GraphModule):
            out += _graph_schedules(child, join_path(prefix, name))
    return out


__all__ = ["FindPrimitive", "Pattern", "traced_module"]
