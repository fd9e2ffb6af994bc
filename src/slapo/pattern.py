"""Patterns and structural subgraph matching for ``find``.

A pattern is a function, a :class:`Pattern` subclass or a :class:`ModulePattern`. It is traced
with torch.fx into a small graph whose placeholders match anything; ``call_module(regex, *args)``
inside a pattern matches a call of a submodule whose name matches ``regex``. Matching compares
operations by a canonical name (``operator.add``, ``torch.add`` and ``aten.add.Tensor`` are all
``add``), so a pattern written with torch functions matches graphs captured by torch.export too.
It is structural: it walks the data flow back from the pattern's output, tries both argument
orders of commutative operations, and returns every non-overlapping match.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch
from torch import fx, nn

from .exceptions import SlapoError
from .tracing import ModeDropout

__all__ = [
    "Pattern",
    "ModulePattern",
    "Subgraph",
    "call_module",
    "find_call_modules",
    "find_pattern",
    "trace_pattern",
]


class Pattern(nn.Module):
    """Base class of subgraph patterns: implement ``forward`` with the computation to find.

    Example:
        >>> class BiasGeLU(Pattern):
        ...     def forward(self, x, bias):
        ...         return torch.nn.functional.gelu(x + bias)
    """

    def forward(self, *args: Any) -> Any:
        raise NotImplementedError("a Pattern subclass implements forward()")


class ModulePattern(nn.Module):
    """Matches one call of a submodule whose name matches the regex ``name``.

    Use it as a pattern by itself, or as a child of a :class:`Pattern`.

    Example:
        >>> class QProj(Pattern):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.q = ModulePattern(r"q_proj")
        ...     def forward(self, x):
        ...         return self.q(x)
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, *args: Any) -> Any:
        return call_module(self.name, *args)


def call_module(regex: str, *args: Any) -> Any:
    """Inside a pattern: a call of any submodule whose name matches ``regex``.

    Example:
        >>> pattern = lambda x: torch.relu(call_module(r"fc\\d", x))
    """
    proxies = [a for a in args if isinstance(a, fx.Proxy)]
    if not proxies:
        raise SlapoError("call_module() is only meaningful inside a pattern passed to find()")
    return proxies[0].tracer.create_proxy("call_function", call_module, (regex, *args), {})


@dataclass
class Subgraph(Sequence[tuple[str, fx.Node]]):
    """A matched part of a traced module's graph: a sequence of ``(path, node)`` pairs.

    Indexing and iteration give Slapo's ``(path, node)`` pairs, so code written for Slapo reads a
    match as it always did; the fields below say more about it.

    Attributes:
        path: schedule path (relative to the schedule ``find`` ran on) of the GraphModule whose
            graph holds the nodes.
        nodes: the matched nodes, in graph order.
        inputs: values from outside the subgraph, one per pattern placeholder (or, for a module
            call, its arguments).
        output: the node whose value the subgraph produces.

    Example:
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
        >>> subgraphs = sch.find(lambda x: torch.nn.functional.gelu(x))
        >>> path, node = subgraphs[0][0]
        >>> path, node.op, len(subgraphs[0])
        ('', 'call_module', 1)
    """

    path: str
    nodes: list[fx.Node]
    inputs: list[Any]
    output: fx.Node
    kwargs: dict[str, Any] = field(default_factory=dict)

    @overload
    def __getitem__(self, index: int) -> tuple[str, fx.Node]: ...

    @overload
    def __getitem__(self, index: slice) -> list[tuple[str, fx.Node]]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [(self.path, n) for n in self.nodes[index]]
        return (self.path, self.nodes[index])

    def __iter__(self) -> Iterator[tuple[str, fx.Node]]:
        return ((self.path, n) for n in self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, item: object) -> bool:
        # A bare node is a member too, as when a match iterated over its nodes.
        if isinstance(item, tuple) and len(item) == 2:
            path, item = item
            if path != self.path:
                return False
        return any(item is n for n in self.nodes)

    def __repr__(self) -> str:
        ops = ", ".join(n.name for n in self.nodes)
        return f"Subgraph(path={self.path!r}, nodes=[{ops}])"


# ----- canonical operation names ---------------------------------------------------------------
_OPERATOR_NAMES = {
    operator.add: "add",
    operator.iadd: "add",
    operator.sub: "sub",
    operator.mul: "mul",
    operator.imul: "mul",
    operator.truediv: "div",
    operator.matmul: "matmul",
    operator.neg: "neg",
    operator.pow: "pow",
    operator.getitem: "getitem",
}
_COMMUTATIVE = {"add", "mul"}
_ACTIVATION_MODULES = {
    nn.GELU: "gelu",
    nn.ReLU: "relu",
    nn.SiLU: "silu",
    nn.Tanh: "tanh",
    nn.Sigmoid: "sigmoid",
    nn.Dropout: "dropout",
}


def _op_name(node: fx.Node, owner: nn.Module | None) -> str | None:
    """A canonical name of what ``node`` computes, equal across tracers."""
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return target._opname
        if isinstance(target, torch._ops.OpOverloadPacket):
            return target._qualified_op_name.split("::")[-1]
        if target in _OPERATOR_NAMES:
            return _OPERATOR_NAMES[target]
        name = getattr(target, "__name__", None)
        return name.rstrip("_") if name else None
    if node.op == "call_method":
        return str(node.target).rstrip("_")
    if node.op == "call_module" and owner is not None:
        mod = owner.get_submodule(str(node.target))
        if isinstance(mod, ModeDropout):
            return "dropout"
        for cls, name in _ACTIVATION_MODULES.items():
            if type(mod) is cls:
                return name
    return None


# ----- tracing a pattern -----------------------------------------------------------------------
class _PatternTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return False  # ModulePattern.forward emits call_module(); nothing else is a leaf


def trace_pattern(pattern: Callable | nn.Module) -> fx.Graph:
    """Trace a pattern function or module into an fx graph."""
    try:
        return _PatternTracer().trace(pattern)
    except Exception as exc:  # noqa: BLE001  (explained below)
        raise SlapoError(
            f"cannot trace the pattern {getattr(pattern, '__name__', pattern)!r} with torch.fx: "
            f"{exc}; write it with torch operations on its arguments only"
        ) from exc


# ----- matching --------------------------------------------------------------------------------
class _Matcher:
    def __init__(self, pattern: fx.Graph, owner: nn.Module) -> None:
        self.pattern = pattern
        self.owner = owner
        self.placeholders = [n for n in pattern.nodes if n.op == "placeholder"]
        outputs = [n for n in pattern.nodes if n.op == "output"]
        out = outputs[0].args[0]
        if not isinstance(out, fx.Node) or out.op == "placeholder":
            raise SlapoError("a pattern must return the result of one operation (not a tuple)")
        self.anchor = out

    def match(self, node: fx.Node) -> dict[fx.Node, Any] | None:
        env: dict[fx.Node, Any] = {}
        return env if self._match(self.anchor, node, env) else None

    def _match(self, p: fx.Node, t: Any, env: dict[fx.Node, Any]) -> bool:
        if p in env:
            return env[p] is t or (not isinstance(t, fx.Node) and env[p] == t)
        if p.op == "placeholder":
            env[p] = t
            return True
        if not isinstance(t, fx.Node) or t in env.values():
            return False
        if p.op == "get_attr":
            return False
        if p.op == "call_function" and p.target is call_module:
            if t.op != "call_module" or not _name_matches(p.args[0], str(t.target)):
                return False
            pargs, commutative = list(p.args[1:]), False
        else:
            name = _op_name(p, None)
            if name is None or name != _op_name(t, self.owner):
                return False
            pargs, commutative = list(p.args), name in _COMMUTATIVE
        env[p] = t
        if self._match_args(pargs, list(t.args), env, commutative):
            return True
        del env[p]
        return False

    def _match_args(
        self, pargs: list[Any], targs: list[Any], env: dict[fx.Node, Any], commutative: bool
    ) -> bool:
        orders = [targs]
        if commutative and len(targs) == 2:
            orders.append(targs[::-1])
        for order in orders:
            trial = dict(env)
            if self._args_equal(pargs, order, trial):
                env.clear()
                env.update(trial)
                return True
        return False

    def _args_equal(self, pargs: list[Any], targs: list[Any], env: dict[fx.Node, Any]) -> bool:
        for i, p in enumerate(pargs):
            if i >= len(targs):
                if isinstance(p, fx.Node):
                    return False
                continue
            t = targs[i]
            if isinstance(p, fx.Node):
                if not self._match(p, t, env):
                    return False
            elif isinstance(p, int | float) and isinstance(t, int | float) and p != t:
                return False
        return True


def _name_matches(regex: str, target: str) -> bool:
    return bool(re.fullmatch(regex, target) or re.fullmatch(regex, target.rsplit(".", 1)[-1]))


def find_pattern(gm: fx.GraphModule, pattern: Any, path: str = "") -> list[Subgraph]:
    """Every non-overlapping match of ``pattern`` in ``gm``'s graph, in graph order.

    Example:
        >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        >>> [s.output.name for s in find_pattern(gm, lambda x: torch.relu(x))]
        ['_1']
    """
    if isinstance(pattern, ModulePattern):
        return find_call_modules(gm, pattern.name, path)
    graph = pattern if isinstance(pattern, fx.Graph) else trace_pattern(pattern)
    for node in graph.nodes:  # a bad regex fails here (re.error), even with nothing to match
        if node.op == "call_function" and node.target is call_module:
            re.compile(node.args[0])
    matcher = _Matcher(graph, gm)
    used: set[fx.Node] = set()
    found: list[Subgraph] = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if node in used:
            continue
        env = matcher.match(node)
        if env is None:
            continue
        inner = [env[n] for n in graph.nodes if n.op not in ("placeholder", "output") and n in env]
        if used.intersection(inner):
            continue
        used.update(inner)
        inputs = [env.get(ph) for ph in matcher.placeholders]
        found.append(Subgraph(path, sorted(inner, key=order.__getitem__), inputs, node))
    return found


def find_call_modules(gm: fx.GraphModule, regex: str, path: str = "") -> list[Subgraph]:
    """Every call of a submodule of ``gm`` whose name matches ``regex``.

    Example:
        >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        >>> [s.output.target for s in find_call_modules(gm, r"0")]
        ['0']
    """
    re.compile(regex)  # a bad regex fails here (re.error), even with nothing to match
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and _name_matches(regex, str(node.target)):
            found.append(Subgraph(path, [node], list(node.args), node, dict(node.kwargs)))
    return found
