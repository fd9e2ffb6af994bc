"""Module hooks across inlining: a module call that is inlined into its caller's graph takes its
forward hooks along, as calls recorded in the graph.

Hooks marked with :func:`traceable_hook` (``sync``'s) work on fx proxies: run on proxies of the
call's arguments and result, they record their op in the graph. A module with any other forward
or backward hook is not inlined (its call stays, and its hooks keep firing at run time).

Example:
    >>> from torch import nn
    >>> relu = nn.ReLU()
    >>> _ = relu.register_forward_hook(traceable_hook(lambda mod, args, out: out * 2))
    >>> inlinable(relu), inlinable(nn.ReLU())
    (True, True)
    >>> _ = relu.register_forward_hook(lambda mod, args, out: out)
    >>> inlinable(relu)
    False
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import fx, nn

__all__ = ["inlinable", "post_hooks_in_graph", "pre_hooks_in_graph", "traceable_hook"]

_TRACEABLE = "_slapo_traceable_hook"
_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def traceable_hook(hook: _Hook) -> _Hook:
    """Mark a forward (pre-)hook as one that records itself in a graph when given fx proxies."""
    setattr(hook, _TRACEABLE, True)
    return hook


def inlinable(mod: nn.Module) -> bool:
    """Whether every hook on ``mod`` can be recorded in its caller's graph (or it has none)."""
    if getattr(mod, "_backward_hooks", None) or getattr(mod, "_backward_pre_hooks", None):
        return False
    hooks = [*mod._forward_pre_hooks.values(), *mod._forward_hooks.values()]
    return all(getattr(h, _TRACEABLE, False) for h in hooks)


def pre_hooks_in_graph(
    graph: fx.Graph, mod: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]]:
    """Run ``mod``'s forward pre-hooks on proxies of a call's arguments (recording their ops at
    the graph's insertion point); returns the arguments the call then gets."""
    if not mod._forward_pre_hooks:
        return args, kwargs
    pargs, pkw = _proxies(graph, (tuple(args), dict(kwargs)))
    for key, hook in mod._forward_pre_hooks.items():
        if key in mod._forward_pre_hooks_with_kwargs:
            res = hook(mod, pargs, pkw)
            if res is not None:
                pargs, pkw = res
        else:
            res = hook(mod, pargs)
            if res is not None:
                pargs = res if isinstance(res, tuple) else (res,)
    return _nodes((tuple(pargs), dict(pkw)))


def post_hooks_in_graph(
    graph: fx.Graph, mod: nn.Module, args: tuple, kwargs: dict[str, Any], result: Any
) -> Any:
    """Run ``mod``'s forward hooks on proxies of a call's arguments and result; returns the
    result the caller then sees."""
    if not mod._forward_hooks:
        return result
    pargs, pkw, out = _proxies(graph, (tuple(args), dict(kwargs), result))
    for key, hook in mod._forward_hooks.items():
        if key in mod._forward_hooks_with_kwargs:
            res = hook(mod, pargs, pkw, out)
        else:
            res = hook(mod, pargs, out)
        if res is not None:
            out = res
    return _nodes(out)


def _proxies(graph: fx.Graph, value: Any) -> Any:
    tracer = fx.proxy.GraphAppendingTracer(graph)
    return fx.node.map_aggregate(
        value, lambda v: fx.Proxy(v, tracer) if isinstance(v, fx.Node) else v
    )


def _nodes(value: Any) -> Any:
    return fx.node.map_aggregate(value, lambda v: v.node if isinstance(v, fx.Proxy) else v)
