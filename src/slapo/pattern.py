"""Patterns and structural subgraph matching for ``find``.

A pattern is a function, a :class:`Pattern` subclass or a :class:`ModulePattern`. It is traced
with torch.fx into a small graph whose placeholders match anything (a placeholder used twice, as
in a residual ``F.relu(x) + x``, matches one value used twice); ``call_module(regex, *args)``
inside a pattern matches a call of a submodule whose name or class name matches ``regex``. Name
regexes match as Slapo's did, with :func:`re.match`: from the start of the name, not necessarily
to its end (``r"fc?"`` matches ``fc1`` and ``fc2``; end one with ``$`` to match whole names); a
class name matches whole. The
submodules of a :class:`Pattern` (``self.linear = nn.Linear(1, 1)``) stay calls in the pattern's
graph and match calls of any module of their type, whatever its sizes. Matching compares
operations by a canonical name (``operator.add``, ``torch.add`` and ``aten.add.Tensor`` are all
``add``; ``nn.ReLU``, ``F.relu`` and ``torch.relu`` are all ``relu``; ``nn.LayerNorm`` and
``F.layer_norm`` are ``layer_norm``), so a pattern written with torch functions matches graphs
captured by torch.export too, and a module form matches the functional one (a constant the
functional form is given, as ``F.layer_norm``'s normalized shape, must agree with the module's).
It is structural: it walks the data flow back from each of the pattern's outputs
(a pattern may return a tuple: independent branches, such as q/k/v projections of one input),
tries both argument orders of commutative operations, and returns every non-overlapping match.
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
from .tracing import ModeDropout, dynamo_name

__all__ = [
    "Pattern",
    "ModulePattern",
    "Subgraph",
    "call_module",
    "find_call_modules",
    "find_pattern",
    "module_names",
    "trace_pattern",
]


class Pattern(nn.Module):
    """Base class of subgraph patterns: implement ``forward`` with the computation to find.

    Submodules stay module calls in the pattern and match a call of any module of the same type
    (sizes do not matter); activations also match their functional forms.

    Example:
        >>> class BiasGeLU(Pattern):
        ...     def forward(self, x, bias):
        ...         return torch.nn.functional.gelu(x + bias)
        >>> class LinearReLU(Pattern):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.linear = nn.Linear(1, 1)  # any nn.Linear
        ...         self.relu = nn.ReLU()  # nn.ReLU, F.relu or torch.relu
        ...     def forward(self, x):
        ...         return self.relu(self.linear(x))
    """

    def forward(self, *args: Any) -> Any:
        raise NotImplementedError("a Pattern subclass implements forward()")


class ModulePattern(nn.Module):
    """Matches one call of a submodule whose name matches the regex ``name``.

    Use it as a pattern by itself, or as a child of a :class:`Pattern`: it then matches a call of
    every submodule whose name matches (see :func:`call_module` for how names match).

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
    """Inside a pattern: a call of any submodule whose name (its last part or its dotted path)
    matches ``regex`` as :func:`re.match` does, from the start of the name (``r"fc?"`` matches
    ``fc1``; ``r"fc\\d$"`` does not match ``fc12``), or whose class name matches it whole
    (``"ReLU"``). In a graph traced with ``tracer="dynamo"``, dynamo's name of the call
    (``self_query`` for ``query``) matches too.

    Example:
        >>> pattern = lambda x: torch.relu(call_module(r"fc\\d", x))
        >>> by_class = lambda x: call_module("ReLU", x)  # every nn.ReLU call
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
        output: the node whose value the subgraph produces (the first one, for a pattern that
            returns a tuple).
        outputs: every node whose value the subgraph produces, in the pattern's return order.

    Example:
        >>> import slapo
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
    outputs: list[fx.Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = [self.output]

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
# Modules that compute one functional operation on their one input: its canonical name, and the
# attributes holding what the functional form takes after the input (F.layer_norm(x, shape)).
_MODULE_OPS: dict[type[nn.Module], tuple[str, tuple[str, ...]]] = {
    nn.GELU: ("gelu", ()),
    nn.ReLU: ("relu", ()),
    nn.SiLU: ("silu", ()),
    nn.Tanh: ("tanh", ()),
    nn.Sigmoid: ("sigmoid", ()),
    nn.Dropout: ("dropout", ("p",)),
    ModeDropout: ("dropout", ("p",)),
    nn.LayerNorm: ("layer_norm", ("normalized_shape",)),
    nn.GroupNorm: ("group_norm", ("num_groups",)),
}
_MODULE_OPS_BY_NAME = {cls.__name__: op for cls, op in _MODULE_OPS.items()}


def _module_op(mod: nn.Module) -> tuple[str, tuple[str, ...]] | None:
    """The functional operation ``mod`` computes (its canonical name and the attributes of its
    constant arguments), or None. torch.export rebuilds such a module as a ``GraphModule`` named
    after its class (``ReLU``), which computes the same."""
    op = _MODULE_OPS.get(type(mod))
    if op is None and isinstance(mod, fx.GraphModule):
        op = _MODULE_OPS_BY_NAME.get(type(mod).__name__)
    return op


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
        op = _module_op(owner.get_submodule(str(node.target)))
        return op[0] if op is not None else None
    return None


def _constants_agree(pargs: list[Any], mod: nn.Module) -> bool:
    """Whether the constants a functional pattern op passes after its input
    (``F.layer_norm(x, 1024)``) equal those of the module a graph calls instead
    (``nn.LayerNorm(1024)``); a constant the pattern leaves out, or gives as a node, agrees."""
    op = _module_op(mod)
    for arg, attr in zip(pargs[1:], op[1] if op is not None else (), strict=False):
        if isinstance(arg, fx.Node) or not hasattr(mod, attr):
            continue
        if _as_tuple(arg) != _as_tuple(getattr(mod, attr)):
            return False
    return True


def _as_tuple(value: Any) -> Any:
    """A shape given as an int or a sequence, as a tuple (other values as they are)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    return tuple(value) if isinstance(value, list | tuple | torch.Size) else value


# ----- tracing a pattern -----------------------------------------------------------------------
# What a pattern's tracer goes into: the pattern classes (ModulePattern.forward emits
# call_module()) and plain containers. Every other submodule stays a call and matches by type.
_TRACED_THROUGH = (Pattern, ModulePattern, nn.Sequential, nn.ModuleList, nn.ModuleDict)


class _PatternTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return not isinstance(m, _TRACED_THROUGH)


def trace_pattern(pattern: Callable | nn.Module) -> fx.Graph:
    """Trace a pattern function or module into an fx graph.

    The graph's ``owning_module`` holds the pattern's submodules under their paths, so that a
    ``call_module`` node of the pattern can be matched by the type of the module it calls.

    Example:
        >>> graph = trace_pattern(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        >>> [n.op for n in graph.nodes]
        ['placeholder', 'call_module', 'call_module', 'output']
    """
    tracer = _PatternTracer()
    try:
        graph = tracer.trace(pattern)
    except Exception as exc:  # noqa: BLE001  (explained below)
        raise SlapoError(
            f"cannot trace the pattern {getattr(pattern, '__name__', pattern)!r} with torch.fx: "
            f"{exc}; write it with torch operations and submodules on its arguments only"
        ) from exc
    return fx.GraphModule(tracer.root, graph).graph


# ----- matching --------------------------------------------------------------------------------
class _Matcher:
    def __init__(self, pattern: fx.Graph, owner: nn.Module) -> None:
        self.pattern = pattern
        self.owner = owner
        self.proot: nn.Module | None = pattern.owning_module
        self.placeholders = [n for n in pattern.nodes if n.op == "placeholder"]
        outputs = [n for n in pattern.nodes if n.op == "output"]
        out = outputs[0].args[0]
        anchors = list(out) if isinstance(out, tuple | list) else [out]
        if not anchors or any(not isinstance(a, fx.Node) or a.op == "placeholder" for a in anchors):
            raise SlapoError(
                "a pattern must return the result of an operation, or a tuple of such results "
                "(independent branches), not one of its inputs or a constant"
            )
        self.anchors: list[fx.Node] = anchors

    def match(self, p: fx.Node, t: Any, env: dict[fx.Node, Any]) -> bool:
        """Match pattern node ``p`` against ``t``; binds into ``env`` (left as it was on failure)."""
        trial = dict(env)
        if not self._match(p, t, trial):
            return False
        env.update(trial)
        return True

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
            if t.op != "call_module" or not _name_matches(p.args[0], self.owner, str(t.target)):
                return False
            pargs, commutative = list(p.args[1:]), False
        elif p.op == "call_module":
            if not self._same_module(p, t):
                return False
            pargs, commutative = list(p.args), False
        else:
            name = _op_name(p, None)
            if name is None or name != _op_name(t, self.owner):
                return False
            pargs, commutative = list(p.args), name in _COMMUTATIVE
            if t.op == "call_module" and not _constants_agree(pargs, self._mod(t)):
                return False
        env[p] = t
        if self._match_args(pargs, list(t.args), env, commutative):
            return True
        del env[p]
        return False

    def _mod(self, t: fx.Node) -> nn.Module:
        return self.owner.get_submodule(str(t.target))

    def _same_module(self, p: fx.Node, t: fx.Node) -> bool:
        """A pattern's module call matches a call of a module of its type (any sizes), or the
        functional form of the same operation (``nn.ReLU`` and ``F.relu``)."""
        if self.proot is None:  # a hand-made graph: no module to compare types with
            return t.op == "call_module" and str(p.target) in _path_names(str(t.target))
        pmod = self.proot.get_submodule(str(p.target))
        if t.op == "call_module":
            tmod = self._mod(t)
            if isinstance(tmod, type(pmod)):
                return True
            # A traced child is a GraphModule named after the class it was traced from.
            if isinstance(tmod, fx.GraphModule) and type(tmod).__name__ == type(pmod).__name__:
                return True
        name = _op_name(p, self.proot)
        return name is not None and name == _op_name(t, self.owner)

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

    def inner(self, env: dict[fx.Node, Any]) -> list[fx.Node]:
        """The target nodes that ``env`` binds to the pattern's operations."""
        return [
            env[n] for n in self.pattern.nodes if n.op not in ("placeholder", "output") and n in env
        ]


def module_names(gm: nn.Module, target: str) -> list[str]:
    """The names by which a name regex finds a call of ``gm``'s submodule ``target``: its path,
    the path's last part and, in a graph traced with ``tracer="dynamo"``, dynamo's name of it
    (:func:`slapo.tracing.dynamo_name`). (Its class name matches too, but whole.)

    Example:
        >>> gm = fx.symbolic_trace(nn.Sequential(nn.Sequential(nn.Linear(2, 2))))
        >>> module_names(gm, "0.0")
        ['0.0', '0']
    """
    alias = dynamo_name(gm, target)
    return _path_names(target) if alias is None else [*_path_names(target), alias]


def _path_names(target: str) -> list[str]:
    return [target, target.rsplit(".", 1)[-1]]


def _name_matches(regex: str, gm: nn.Module, target: str) -> bool:
    """Slapo's name matching, ``re.match`` (anchored at the start of a name only); a class name
    matches whole (``"Linear"`` is no ``LinearWithSeparateBias``)."""
    if any(re.match(regex, n) for n in module_names(gm, target)):
        return True
    return re.fullmatch(regex, type(gm.get_submodule(target)).__name__) is not None


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
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    used: set[fx.Node] = set()
    found: list[Subgraph] = []
    for node in nodes:
        if node in used:
            continue
        env: dict[fx.Node, Any] = {}
        if not matcher.match(matcher.anchors[0], node, env):
            continue
        env = _match_rest(matcher, nodes, env, used)
        if env is None:
            continue
        inner = matcher.inner(env)
        used.update(inner)
        inputs = [env.get(ph) for ph in matcher.placeholders]
        outs = [env[a] for a in matcher.anchors]
        ordered = sorted(inner, key=order.__getitem__)
        found.append(Subgraph(path, ordered, inputs, outs[0], outputs=outs))
    return found


def _match_rest(
    matcher: _Matcher, nodes: list[fx.Node], env: dict[fx.Node, Any], used: set[fx.Node], i: int = 1
) -> dict[fx.Node, Any] | None:
    """Bind the pattern's outputs from the ``i``-th on (independent branches), backtracking; the
    result shares no node with earlier matches (``used``)."""
    if used.intersection(matcher.inner(env)):
        return None
    if i == len(matcher.anchors):
        return env
    for node in nodes:
        if node in used:
            continue
        trial = dict(env)
        if matcher.match(matcher.anchors[i], node, trial):
            done = _match_rest(matcher, nodes, trial, used, i + 1)
            if done is not None:
                return done
    return None


def find_call_modules(gm: fx.GraphModule, regex: str, path: str = "") -> list[Subgraph]:
    """Every call of a submodule of ``gm`` whose name or class name matches ``regex``.

    Example:
        >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        >>> [s.output.target for s in find_call_modules(gm, r"0")]
        ['0']
        >>> [s.output.target for s in find_call_modules(gm, "ReLU")]
        ['1']
    """
    re.compile(regex)  # a bad regex fails here (re.error), even with nothing to match
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        if _name_matches(regex, gm, str(node.target)):
            found.append(Subgraph(path, [node], list(node.args), node, dict(node.kwargs)))
    return found
