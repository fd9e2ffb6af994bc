"""``fuse``: turn a matched subgraph into one named (compiled) module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from ..exceptions import PrimitiveError
from ..logger import get_logger
from ..pattern import Subgraph
from ..schedule import Primitive, Schedule, register_primitive
from ..surgery import label
from .subgraph_replace import replace_each

Compiler = str | Callable[..., Any] | None

#: The compiler of a ``fuse`` that names none: TorchScript where it scripts the subgraph, else the
#: fused module stays eager (Slapo's default was TorchScript; inductor needs a C++ toolchain).
DEFAULT_COMPILER = "default"


def compile_module(gm: fx.GraphModule, compiler: Compiler, where: str) -> nn.Module:
    """Compile ``gm`` in place of its forward; parameter names do not change."""
    if compiler is None:
        return gm
    if compiler == DEFAULT_COMPILER:
        return _script_or_eager(gm, where)
    if isinstance(compiler, str) and compiler.lower() == "torchscript":
        script = getattr(torch.jit, "script", None)
        if script is None:
            raise PrimitiveError(
                f'fuse on "{where}": this torch has no TorchScript; use compiler="inductor"'
            )
        try:
            return script(gm)
        except Exception as exc:  # noqa: BLE001  (re-raised with advice)
            raise PrimitiveError(
                f'fuse on "{where}": TorchScript cannot compile the subgraph ({exc}); use '
                'compiler="inductor" or None'
            ) from exc
    if isinstance(compiler, str) or callable(compiler):
        gm.compile(backend=compiler)  # a torch.compile backend name or backend function
        return gm
    raise PrimitiveError(
        f'fuse on "{where}": compiler must be "inductor", "TorchScript", another torch.compile '
        f"backend (name or function), or None; got {compiler!r}"
    )


def _script_or_eager(gm: fx.GraphModule, where: str) -> nn.Module:
    """``torch.jit.script(gm)``, or ``gm`` itself (eager) where TorchScript cannot compile it."""
    script = getattr(torch.jit, "script", None)
    if script is not None:
        try:
            return script(gm)
        except Exception as exc:  # noqa: BLE001  (the default falls back; an explicit one raises)
            reason = f"TorchScript cannot compile it ({type(exc).__name__})"
    else:
        reason = "this torch has no TorchScript"
    get_logger().info(
        f'fuse on "{where}": {reason}; the fused module runs eagerly (pass compiler= to choose)'
    )
    return gm


def number_modules(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with the modules its graph calls held as children ``"0"``, ``"1"``, ... in the
    order of their first call, as Slapo's fused modules hold them (a module called twice is one
    child). ``gm``'s graph is reused; its class name is kept.

    Example:
        >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        >>> [name for name, _ in number_modules(gm).named_children()]
        ['0', '1']
    """
    holder = nn.Module()
    numbers: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        target = str(node.target)
        if target not in numbers:
            numbers[target] = str(len(numbers))
            holder.add_module(numbers[target], gm.get_submodule(target))
        node.target = numbers[target]
    return fx.GraphModule(holder, gm.graph, class_name=type(gm).__name__)


_UNSET: Any = object()


def _is_subgraph(value: Any) -> bool:
    """Whether ``value`` is what ``find`` returns: a Subgraph, a node, or a list of them."""
    if isinstance(value, Subgraph | fx.Node):
        return True
    return isinstance(value, list | tuple) and all(isinstance(v, Subgraph) for v in value)


def _is_compiler(value: Any) -> bool:
    return value is None or isinstance(value, str) or (callable(value) and not _is_subgraph(value))


def fuse_arguments(sch: Schedule, first: Any, second: Any, subgraph: Any, compiler: Any) -> tuple:
    """``(subgraph, compiler)`` from ``fuse(compiler, subgraph)`` (the seed's order) or
    ``fuse(subgraph, compiler)``, told apart by type; keywords fill in what is not positional.

    Example:
        >>> import slapo, torch
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
        >>> found = sch.find(lambda x: torch.nn.functional.gelu(x))
        >>> fuse_arguments(sch, "TorchScript", found, _UNSET, _UNSET) == (found, "TorchScript")
        True
    """
    given = [v for v in (first, second) if v is not _UNSET]
    for value in given:
        if _is_subgraph(value):
            if subgraph is not _UNSET:
                raise PrimitiveError(f'fuse on "{label(sch.path)}": the subgraph is given twice')
            subgraph = value
        elif _is_compiler(value):
            if compiler is not _UNSET:
                raise PrimitiveError(f'fuse on "{label(sch.path)}": the compiler is given twice')
            compiler = value
        else:
            raise PrimitiveError(
                f'fuse on "{label(sch.path)}": {type(value).__name__} is neither a subgraph '
                "(what find() returns) nor a compiler (a name, a backend function or None); "
                'call fuse(compiler, subgraph), e.g. fuse("TorchScript", sch.find(pattern))'
            )
    if subgraph is _UNSET:
        raise PrimitiveError(
            f'fuse on "{label(sch.path)}" needs the subgraph to fuse: '
            "fuse(compiler, sch.find(pattern))"
        )
    return subgraph, DEFAULT_COMPILER if compiler is _UNSET else compiler


@register_primitive()
class FusePrimitive(Primitive):
    """Fuse a subgraph found by ``find`` into one module, compiled by ``compiler``.

    Both ``fuse(compiler, subgraph)`` (Slapo's order) and ``fuse(subgraph, compiler=...)`` work;
    the arguments are told apart by type. ``compiler`` is ``"TorchScript"`` (``torch.jit.script``
    of the fused graph, where torch still has it), ``"inductor"`` (torch.compile) or any other
    torch.compile backend (a name or a function), or None to keep the fused module eager. Without
    one (or with ``"default"``), the subgraph is scripted where TorchScript can compile it, else
    kept as an eager fused module (noted in the log).
    Each match becomes a submodule ``<name>_0``, ``<name>_1``, ... (Slapo's naming), reachable as
    ``sch["<name>_0"]``: a module of class ``name`` whose children are the modules the match
    calls, in call order, named ``"0"``, ``"1"``, ... (their parameters move with them). The
    subgraph's intermediate values must not be used outside it. Returns the fused modules' names.

    Example:
        >>> import slapo, torch
        >>> import torch.nn.functional as F
        >>> class MLP(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = nn.Linear(4, 4, bias=False)
        ...         self.bias = nn.Parameter(torch.zeros(4))
        ...     def forward(self, x):
        ...         return F.gelu(self.bias + self.fc(x))
        >>> sch = slapo.create_schedule(MLP())
        >>> subgraph = sch.find(lambda x, bias: F.gelu(bias + x))
        >>> sch.fuse(subgraph, compiler="TorchScript", name="BiasGeLU")  # or fuse(compiler, ...)
        ['BiasGeLU_0']
    """

    name = "fuse"

    @staticmethod
    def apply(
        sch: Schedule,
        compiler_or_subgraph: Any = _UNSET,
        subgraph_or_compiler: Any = _UNSET,
        name: str = "FusedModule",
        *,
        compiler: Compiler = _UNSET,
        subgraph: Any = _UNSET,
    ) -> list[str]:
        found, compiler = fuse_arguments(
            sch, compiler_or_subgraph, subgraph_or_compiler, subgraph, compiler
        )
        return replace_each(
            sch,
            found,
            "fuse",
            name,
            name,
            lambda gm, owner: compile_module(number_modules(gm), compiler, label(owner.path)),
            numbered=True,
        )
