"""``fuse``: turn a matched subgraph into one named (compiled) module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from ..exceptions import PrimitiveError
from ..schedule import Primitive, Schedule, register_primitive
from ..surgery import label
from .subgraph_replace import replace_each

Compiler = str | Callable[..., Any] | None


def compile_module(gm: fx.GraphModule, compiler: Compiler, where: str) -> nn.Module:
    """Compile ``gm`` in place of its forward; parameter names do not change."""
    if compiler is None:
        return gm
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


@register_primitive()
class FusePrimitive(Primitive):
    """Fuse a subgraph found by ``find`` into one module, compiled by ``compiler``.

    ``compiler`` is ``"inductor"`` (torch.compile), any other torch.compile backend (a name or a
    function), ``"TorchScript"`` where torch still has it, or None to keep the fused module
    eager. Several matches are fused one by one (``name``, ``name_0``, ...). The subgraph's
    intermediate values must not be used outside it. Returns the fused modules' names.

    Example:
        >>> subgraph = sch.find(lambda x, bias: F.gelu(bias + x))
        >>> sch.fuse(subgraph, compiler="inductor", name="BiasGeLU")
    """

    name = "fuse"

    @staticmethod
    def apply(
        sch: Schedule, subgraph: Any, compiler: Compiler = "inductor", name: str = "FusedModule"
    ) -> list[str]:
        return replace_each(
            sch,
            subgraph,
            "fuse",
            name,
            name,
            lambda gm, owner: compile_module(gm, compiler, label(owner.path)),
        )
