"""``replace(new_module, subgraph)``: swap part of a traced graph for a module.

Also the graph surgery shared by ``fuse`` and ``checkpoint(subgraph)``: checking that a subgraph
can be cut out, extracting it as a ``GraphModule``, and putting a module call in its place.
"""

from __future__ import annotations

import inspect
import operator
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx, nn

from ..exceptions import PrimitiveError
from ..logger import get_logger
from ..pattern import Subgraph
from ..schedule import Schedule
from ..surgery import label, unique_name

__all__ = [
    "bind_concrete_args",
    "check_closed",
    "extract",
    "normalize",
    "replace_each",
    "replace_subgraph",
    "substitute",
]


def normalize(sch: Schedule, subgraph: Any, primitive: str) -> list[Subgraph]:
    """A list of subgraphs from what ``find`` returned; warns and returns [] if it is empty."""
    if isinstance(subgraph, Subgraph):
        return [subgraph]
    if isinstance(subgraph, fx.Node):
        return [Subgraph("", [subgraph], list(subgraph.args), subgraph, dict(subgraph.kwargs))]
    if isinstance(subgraph, Sequence) and all(isinstance(s, Subgraph) for s in subgraph):
        if not subgraph:
            msg = (
                f'{primitive} on "{label(sch.path)}" got an empty match: find() found '
                "nothing, so nothing is changed; check the pattern or regex"
            )
            warnings.warn(msg, UserWarning, stacklevel=4)
            get_logger().warning(msg)
        return list(subgraph)
    raise PrimitiveError(
        f"{primitive} expects what find() returns (a Subgraph or a list of them), got "
        f"{type(subgraph).__name__}"
    )


def owner_of(sch: Schedule, subgraphs: list[Subgraph], primitive: str) -> Schedule:
    """The schedule whose graph holds all ``subgraphs``."""
    paths = {s.path for s in subgraphs}
    if len(paths) != 1:
        raise PrimitiveError(
            f"{primitive}: the subgraphs live in different graphs ({sorted(paths)}); "
            "pass the matches of one graph at a time"
        )
    owner = sch[paths.pop()]
    if not isinstance(owner.mod, fx.GraphModule):
        raise PrimitiveError(f'{primitive}: "{owner.path}" is not a traced module')
    graph_nodes = set(owner.mod.graph.nodes)
    for s in subgraphs:
        if any(n not in graph_nodes for n in s.nodes):
            raise PrimitiveError(
                f'{primitive}: {s} is not in the graph of "{label(owner.path)}" any more '
                "(stale match); call find() again after changing the graph"
            )
    return owner


def check_closed(sub: Subgraph, primitive: str) -> None:
    """Raise if a value computed inside ``sub`` (other than its outputs) is used outside it."""
    inside = set(sub.nodes)
    for node in sub.nodes:
        if any(node is out for out in sub.outputs):
            continue
        outside = [u for u in node.users if u not in inside]
        if outside:
            raise PrimitiveError(
                f"{primitive}: the subgraph's intermediate value {node.name} escapes: it is also "
                f"used by {', '.join(u.name for u in outside)} outside the subgraph. Only its "
                "output may be used outside; match a larger pattern that covers those uses"
            )


def external_inputs(subs: list[Subgraph]) -> list[fx.Node]:
    """Nodes defined outside the subgraphs that they read, in first-use order (deduplicated)."""
    inside = {n for s in subs for n in s.nodes}
    seen: list[fx.Node] = []
    for s in subs:
        for node in s.nodes:
            for arg in node.all_input_nodes:
                if arg not in inside and arg not in seen:
                    seen.append(arg)
    return seen


def extract(owner: fx.GraphModule, sub: Subgraph, class_name: str) -> tuple[fx.GraphModule, list]:
    """Copy ``sub`` into a standalone GraphModule; returns it and the values it takes.

    Parameters read with ``get_attr`` stay in the owner and become inputs, so no parameter
    changes owner; module calls inside the subgraph share the called module.
    """
    inputs = external_inputs([sub])
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    taken: list[fx.Node] = []
    for value in inputs:
        env[value] = graph.placeholder(_safe(value.name))
        taken.append(value)
    for node in sub.nodes:
        if node.op == "get_attr":  # keep parameters where they are: pass them in
            env[node] = graph.placeholder(_safe(node.name))
            taken.append(node)
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    outs = [env[o] for o in sub.outputs]
    graph.output(outs[0] if len(outs) == 1 else tuple(outs))  # branches: a tuple, in order
    holder = nn.Module()
    for node in sub.nodes:
        if node.op == "call_module":
            _copy_module(holder, str(node.target), owner.get_submodule(str(node.target)))
    gm = fx.GraphModule(holder, graph, class_name=class_name)
    # get_attr nodes were turned into inputs: they are read in the owner, before the call.
    return gm, taken


def replace_each(
    sch: Schedule,
    subgraph: Any,
    primitive: str,
    name: str,
    class_name: str,
    make: Callable[[fx.GraphModule, Schedule], nn.Module],
    keep_called: bool = False,
    numbered: bool = False,
) -> list[str]:
    """Cut each subgraph out into a ``GraphModule`` ``gm`` and call ``make(gm, owner)`` in its
    place (``owner``: the schedule whose graph held it); returns the new modules' names.
    ``keep_called``: the modules the subgraph calls stay registered where they were (the new
    module must then not register ``gm`` as a submodule, so no parameter is renamed).
    ``numbered``: name the modules ``name_0``, ``name_1``, ... (see :func:`substitute`).

    Example:
        >>> import slapo, torch
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
        >>> pattern = lambda x: torch.nn.functional.gelu(x)  # noqa: E731
        >>> replace_each(sch, sch.find(pattern), "fuse", "Fused", "Fused", lambda gm, owner: gm)
        ['Fused']
    """
    names = []
    for sub in normalize(sch, subgraph, primitive):
        owner = owner_of(sch, [sub], primitive)
        check_closed(sub, primitive)
        gm, inputs = extract(owner.mod, sub, class_name)
        module = make(gm, owner)
        names.append(
            substitute(
                owner, [sub], module, name, inputs, keep_called=keep_called, numbered=numbered
            )
        )
    return names


def _copy_module(holder: nn.Module, path: str, mod: nn.Module) -> None:
    parts = path.split(".")
    for part in parts[:-1]:
        if not hasattr(holder, part):
            holder.add_module(part, nn.Module())
        holder = getattr(holder, part)
    holder.add_module(parts[-1], mod)


def _safe(name: str) -> str:
    return re.sub(r"\W", "_", name)


def substitute(
    owner_sch: Schedule,
    subs: list[Subgraph],
    module: nn.Module,
    name: str,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    keep_called: bool = False,
    numbered: bool = False,
) -> str:
    """Call ``module(*args, **kwargs)`` in place of ``subs``; output i feeds chain i's users.

    With one output in all (one subgraph of one chain) the module's output replaces it; with
    several (horizontal fusion: several subgraphs, or one match of a pattern with several
    branches) the module returns a tuple with one element per output, in order.
    Returns the name under which the module is registered in the owner: ``name`` if it is
    free, else ``name_<i>``; with ``numbered`` always ``name_<i>``, the first free ``i`` (Slapo's
    naming: ``BiasGeLU_0``, ``BiasGeLU_1``, ...). The submodules that only ``subs`` called are
    removed, unless ``keep_called``.
    """
    gm: fx.GraphModule = owner_sch.mod
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((n for s in subs for n in s.nodes), key=order.__getitem__)
    arg_nodes = [a for a in [*args, *(kwargs or {}).values()] if isinstance(a, fx.Node)]
    late = [a for a in arg_nodes if order[a] > order[first] and not _inside(a, subs)]
    if late:
        raise PrimitiveError(
            f"the subgraphs read {', '.join(a.name for a in late)}, computed after they start; "
            "they cannot be replaced by one call"
        )
    name = unique_name(gm, name or "subgraph", numbered=numbered)
    gm.add_submodule(name, module)
    with graph.inserting_before(first):
        if any(a.op == "get_attr" for a in arg_nodes):
            args = [_hoist(graph, a) for a in args]
        call = graph.call_module(name, tuple(args), dict(kwargs or {}))
        replaced = [o for s in subs for o in s.outputs]
        outs: list[fx.Node] = [call]
        if len(replaced) > 1:
            outs = [graph.call_function(operator.getitem, (call, i)) for i in range(len(replaced))]
    for old, out in zip(replaced, outs, strict=True):
        old.replace_all_uses_with(out)
    removed = {n for s in subs for n in s.nodes}
    called = {str(n.target) for n in removed if n.op == "call_module"}
    for node in sorted(removed, key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    for node in list(graph.nodes):  # parameters read only by the removed nodes
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    if not keep_called:
        _drop_unused(gm, called)
    graph.lint()
    gm.recompile()
    owner_sch.swap_module(gm)
    return name


def _inside(node: fx.Node, subs: list[Subgraph]) -> bool:
    return any(node in s.nodes for s in subs)


def _hoist(graph: fx.Graph, value: Any) -> Any:
    # A get_attr inside the subgraph is about to be erased: read the parameter again here.
    if isinstance(value, fx.Node) and value.op == "get_attr":
        return graph.get_attr(str(value.target))
    return value


def _drop_unused(gm: fx.GraphModule, targets: set[str]) -> None:
    """Remove the submodules whose every call was replaced (their parameters go with them)."""
    still = {str(n.target) for n in gm.graph.nodes if n.op in ("call_module", "get_attr")}
    for target in targets:
        if any(s == target or s.startswith(target + ".") for s in still):
            continue
        owner_path, _, attr = target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        delattr(owner, attr)


def replace_subgraph(
    sch: Schedule,
    new_module: nn.Module,
    subgraph: Any,
    name: str | None = None,
    concrete_args: dict[str, Any] | None = None,
) -> str | None:
    """Replace one matched chain, or several parallel chains (horizontal fusion), by a module.

    One chain: ``new_module`` is called with the chain's inputs (the pattern's arguments in
    order, or a module call's own arguments) and its output replaces the chain's output.
    Several chains: it is called once with the distinct inputs of all chains, in first-use
    order, and must return a tuple whose i-th element replaces the i-th chain's output.
    One match of a pattern that returns a tuple (branches): it is called with the pattern's
    arguments and returns a tuple whose i-th element replaces the i-th branch's output.
    ``concrete_args``: values for the new module's arguments that the subgraph does not supply,
    by name, passed as keywords in every call (e.g. an attention op's mask and dropout ``p``).
    The module is registered as ``<name>_0`` (then ``_1``, ...), ``name`` defaulting to its class
    name, as Slapo names it; the registered name is returned.

    Example:
        >>> import slapo, torch
        >>> from slapo.op import FlashAttentionOp
        >>> class Attention(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, 8) for _ in range(3))
        ...     def forward(self, x):
        ...         q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        ...         return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
        >>> class FusedQKV(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.qkv = nn.Linear(8, 24)
        ...     def forward(self, x):
        ...         return self.qkv(x).chunk(3, dim=-1)
        >>> def scaled_dot_product(q, k, v):
        ...     return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
        >>> attn = slapo.create_schedule(Attention())
        >>> qkv = attn.find(r"[qkv]_proj")  # three module calls on the same input
        >>> attn.replace(FusedQKV(), qkv, name="FusedQKV")  # FusedQKV(x) -> (q, k, v)
        'FusedQKV_0'
        >>> core = attn.find(scaled_dot_product)  # (q, k, v) -> attention
        >>> attn.replace(FlashAttentionOp(), core, concrete_args={"attention_mask": None, "p": 0.1})
        'FlashAttentionOp_0'
    """
    subs = normalize(sch, subgraph, "replace")
    if not subs:
        return None
    owner = owner_of(sch, subs, "replace")
    for s in subs:
        check_closed(s, "replace")
    name = name or type(new_module).__name__
    if len(subs) == 1 and len(subs[0].outputs) == 1:
        s = subs[0]
        single_call = len(s.nodes) == 1 and s.output.op == "call_module"
        args = list(s.output.args) if single_call else _chain_inputs(s)
        kwargs = dict(s.output.kwargs) if single_call else {}
    elif len(subs) == 1:  # one match with several branches: the pattern's arguments, in order
        args, kwargs = _chain_inputs(subs[0]), {}
    else:
        args, kwargs = external_inputs(subs), {}
    kwargs = bind_concrete_args(owner, new_module, args, kwargs, concrete_args)
    return substitute(owner, subs, new_module, name, args, kwargs, numbered=True)


def bind_concrete_args(
    owner: Schedule,
    module: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    concrete_args: dict[str, Any] | None,
) -> dict[str, Any]:
    """``kwargs`` with ``concrete_args`` added, each checked against ``module``'s forward: it must
    name an argument that the subgraph's ``args``/``kwargs`` do not already supply.

    Example:
        >>> import slapo, torch
        >>> from slapo.op import FlashAttentionOp
        >>> owner = slapo.create_schedule(nn.Linear(8, 8))  # the schedule whose graph is edited
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> bind_concrete_args(owner, FlashAttentionOp(), [q, k, v], {}, {"p": 0.1})
        {'p': 0.1}
    """
    if not concrete_args:
        return kwargs
    where = f'replace on "{label(owner.path)}"'
    if not isinstance(concrete_args, dict) or not all(isinstance(k, str) for k in concrete_args):
        raise PrimitiveError(
            f"{where}: concrete_args must be a dict from argument names to values, got "
            f"{concrete_args!r}"
        )
    params = _forward_parameters(module)
    if params is not None:
        by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        positional = [p.name for p in params.values() if p.kind in by_position]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for key in concrete_args:
            if key in positional[: len(args)]:
                raise PrimitiveError(
                    f"{where}: concrete_args sets {key!r}, but the subgraph already passes it to "
                    f"{type(module).__name__} (argument {positional.index(key) + 1} of the "
                    f"{len(args)} it supplies); drop {key!r} from concrete_args"
                )
            known = key in params and params[key].kind is not params[key].POSITIONAL_ONLY
            if not known and not takes_any:
                raise PrimitiveError(
                    f"{where}: {type(module).__name__}.forward takes no keyword argument {key!r} "
                    f"for concrete_args; its arguments are {', '.join(params) or '(none)'}"
                )
    clash = sorted(set(kwargs) & set(concrete_args))
    if clash:
        raise PrimitiveError(
            f"{where}: concrete_args sets {clash}, which the subgraph already passes by keyword; "
            "drop them from concrete_args"
        )
    return {**kwargs, **concrete_args}


def _forward_parameters(module: nn.Module) -> dict[str, inspect.Parameter] | None:
    """The parameters of ``module.forward`` (bound: no ``self``); None where they cannot be read
    (a compiled module), in which case the call itself reports a bad argument."""
    try:
        return dict(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None


def _chain_inputs(sub: Subgraph) -> list[Any]:
    if sub.inputs and all(v is not None for v in sub.inputs):
        return list(sub.inputs)
    return list(external_inputs([sub]))
