"""The torch.fx path: symbolic tracing without inputs, leaves kept as calls, the hierarchy kept
by tracing every non-leaf child into a ``GraphModule`` of its own. With ``hf=True`` the
Hugging Face-aware tracer of :mod:`slapo.tracing.hf_fx` traces (transformers blocks: ``**kwargs``,
shapes unpacked and branched on, attention-interface calls kept)."""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from ..surgery import join_path, move_hooks
from .errors import TraceError, module_stack, raise_trace_error
from .hf_fx import call_example, hf_trace
from .leaves import Leaves, is_leaf

__all__ = ["fx_trace"]


class _LeafTracer(fx.Tracer):
    def __init__(self, root: nn.Module, leaves: Leaves, children_are_leaves: bool) -> None:
        super().__init__()
        self._paths = {id(m): n for n, m in root.named_modules()}
        self._leaves = leaves
        self._children = {id(m) for m in root.children()} if children_are_leaves else set()

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if id(m) in self._children or is_leaf(qualname, m, self._leaves) or _leaf_by_class(m):
            return True
        return super().is_leaf_module(m, qualname)


def _leaf_by_class(mod: nn.Module) -> bool:
    """A module whose class asks to stay a call (``slapo.op.Print``: it prints at run time)."""
    return getattr(type(mod), "_slapo_trace_leaf", False)


def fx_trace(
    mod: nn.Module,
    leaves: Leaves,
    flatten: bool,
    concrete_args: dict[str, Any] | None,
    path: str,
    hf: bool = False,
    config: Any = None,
    example: tuple[tuple, dict[str, Any]] | None = None,
) -> fx.GraphModule:
    """Symbolically trace ``mod``: one graph if ``flatten``, else one per traceable child.

    ``hf``: trace with :func:`~slapo.tracing.hf_fx.hf_trace` (``config`` sizes its synthesized
    inputs, ``example`` gives the meta call to trace for); each child of the hierarchy is
    traced by plain fx, and where that fails by the Hugging Face-aware tracer on the call
    this graph makes of it.

    Example:
        >>> gm = fx_trace(nn.Sequential(nn.Sequential(nn.ReLU())), (), False, None, "")
        >>> type(gm.get_submodule("0")).__name__, isinstance(gm.get_submodule("0"), fx.GraphModule)
        ('Sequential', True)
    """
    tracer = _LeafTracer(mod, leaves, children_are_leaves=not flatten)
    with module_stack(mod) as stack:
        try:
            if hf:
                gm = hf_trace(mod, tracer.is_leaf_module, concrete_args, config, example, path)
            else:
                graph = tracer.trace(mod, concrete_args=concrete_args)
        except Exception as exc:  # noqa: BLE001  (re-raised with the module named)
            raise_trace_error(path, mod, "fx", exc, stack[-1] if stack else "")
    if not hf:
        _keep_argument_names(graph, concrete_args)
        gm = fx.GraphModule(mod, graph, class_name=type(mod).__name__)
    if flatten:
        return gm
    # Keep the hierarchy: trace every child that is neither a leaf nor a torch.nn built-in.
    for name, child in list(gm.named_children()):
        if (
            is_leaf(name, child, leaves)
            or _leaf_by_class(child)
            or isinstance(child, fx.GraphModule)
        ):
            continue
        if fx.Tracer().is_leaf_module(child, name):
            continue
        inner = [_strip(leaf, name) for leaf in leaves]
        where = join_path(path, name)
        try:
            traced = fx_trace(child, inner, False, None, where)
        except TraceError:
            if not hf:
                raise
            # The call this graph makes of the child, as the Hugging Face-aware trace saw it.
            call = call_example(gm, name)
            traced = fx_trace(child, inner, False, None, where, True, config, call)
        # The call stays a call of this child: the hooks on it (sync's, the user's) keep firing.
        move_hooks(child, traced)
        setattr(gm, name, traced)
    return gm


def _keep_argument_names(graph: fx.Graph, concrete_args: dict[str, Any] | None) -> None:
    """fx names the input of a concrete argument ``x_1``: give it its name back, so the graph
    takes the module's keyword arguments (``mask=None``)."""
    if not concrete_args:
        return
    taken = {str(n.target) for n in graph.nodes if n.op == "placeholder"}
    for node in graph.nodes:
        name = str(node.target).removesuffix("_1")
        if node.op == "placeholder" and name in concrete_args and name not in taken:
            node.target = name
            taken.add(name)


def _strip(leaf: str | type, prefix: str) -> str | type:
    if isinstance(leaf, str) and leaf.startswith(prefix + "."):
        return leaf[len(prefix) + 1 :]
    return leaf
