"""Flattening: inline the graphs of traced child modules into their parent's graph."""

from __future__ import annotations

import operator
from collections.abc import Collection
from typing import Any

from torch import fx

from ..logger import get_logger
from ..surgery import join_path
from .hooks import inlinable, post_hooks_in_graph, pre_hooks_in_graph
from .leaves import Leaves, is_leaf

__all__ = ["inline_submodules"]


def inline_submodules(
    gm: fx.GraphModule, leaves: Leaves = (), only: Collection[str] | None = None
) -> fx.GraphModule:
    """Inline every call of a child ``GraphModule`` (recursively) into ``gm``'s own graph.

    Children that are leaves (or not GraphModules) stay calls. Parameters keep their owners and
    paths, so state_dict keys do not change. With ``only``, just the calls of the submodules at
    those paths (relative to ``gm``) are inlined, each into the graph that calls it.

    Example:
        >>> from torch import nn
        >>> from slapo.tracing import trace_module
        >>> gm = trace_module(nn.Sequential(nn.Sequential(nn.Linear(2, 2))), tracer="fx")
        >>> [n.target for n in inline_submodules(gm).graph.nodes if n.op == "call_module"]
        ['0.0']
    """
    if only is not None:
        return _inline_only(gm, set(only))
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_module":
                continue
            sub = gm.get_submodule(node.target)
            if not isinstance(sub, fx.GraphModule) or is_leaf(node.target, sub, leaves):
                continue
            changed |= _inline_one(gm, node, sub)
    gm.graph.lint()
    gm.recompile()
    return gm


def _inline_only(gm: fx.GraphModule, paths: set[str]) -> fx.GraphModule:
    for prefix, owner in list(gm.named_modules()):
        if not isinstance(owner, fx.GraphModule):
            continue
        calls = [
            n
            for n in owner.graph.nodes
            if n.op == "call_module"
            and join_path(prefix, str(n.target)) in paths
            and isinstance(owner.get_submodule(str(n.target)), fx.GraphModule)
        ]
        inlined = [_inline_one(owner, n, owner.get_submodule(str(n.target))) for n in calls]
        if any(inlined):
            owner.graph.lint()
            owner.recompile()
    return gm


def _inline_one(gm: fx.GraphModule, call: fx.Node, sub: fx.GraphModule) -> bool:
    """Inline one call of ``sub``; its forward hooks become calls in the graph (``sync``'s).
    Returns False, leaving the call, where ``sub`` has hooks a graph cannot hold."""
    if not inlinable(sub):
        get_logger().warning(
            'kept the call of "%s" (%s) in the graph: it has hooks that an inlined graph cannot '
            "run; remove them to flatten it",
            call.target,
            type(sub).__name__,
        )
        return False
    graph = gm.graph
    prefix = call.target
    with graph.inserting_before(call):
        args, kwargs = pre_hooks_in_graph(graph, sub, tuple(call.args), dict(call.kwargs))
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for i, ph in enumerate(placeholders):
        if i < len(args):
            env[ph] = args[i]
        elif ph.target in kwargs:
            env[ph] = kwargs[ph.target]
        else:
            env[ph] = ph.args[0] if ph.args else None
    result: Any = None
    with graph.inserting_before(call):
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                result = fx.node.map_arg(node.args[0], lambda n: env[n])
                continue
            new = graph.node_copy(node, lambda n: env[n])
            if node.op in ("get_attr", "call_module"):
                new.target = f"{prefix}.{node.target}"
            env[node] = new
        result = post_hooks_in_graph(graph, sub, args, kwargs, result)
    if isinstance(result, fx.Node) or result is None:
        call.replace_all_uses_with(result)  # type: ignore[arg-type]
    else:
        # A tuple output: users index into it with getitem; forward them to the element.
        for user in list(call.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                graph.erase_node(user)
            else:
                with graph.inserting_before(user):
                    tup = graph.call_function(tuple, (list(result),))
                user.replace_input_with(call, tup)
    graph.erase_node(call)
    return True
