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

    With ``subgraph`` (what ``find`` returns) only that part of the traced graph is replaced
    (see :func:`~slapo.primitives.subgraph_replace.replace_subgraph`): ``name`` names the new
    submodule (``<name>_0``), and ``concrete_args`` binds, by name, the new module's arguments
    that the subgraph does not supply.

    Example:
        >>> import slapo
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
        >>> sch["1"].replace(nn.ReLU())
        >>> import torch
        >>> from slapo.op import FlashAttentionOp
        >>> class Core(nn.Module):
        ...     def forward(self, q, k, v):
        ...         return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
        >>> def scaled_dot_product(q, k, v):
        ...     return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
        >>> attn_sch = slapo.create_schedule(Core())
        >>> core = attn_sch.find(scaled_dot_product)  # q, k, v -> attention output
        >>> attn_sch.replace(
        ...     FlashAttentionOp("native_xformers"), core,
        ...     concrete_args={"attention_mask": None, "p": 0.1},
        ... )
        'FlashAttentionOp_0'
    """

    name = "replace"

    @staticmethod
    def apply(
        sch: Schedule,
        new_module: nn.Module,
        subgraph: Any = None,
        name: str | None = None,
        concrete_args: dict[str, Any] | None = None,
    ) -> str | None:
        if not isinstance(new_module, nn.Module):
            raise PrimitiveTypeError(
                f'replace on "{label(sch.path)}" needs an nn.Module, got '
                f"{type(new_module).__name__}; wrap a function in an nn.Module first"
            )
        if subgraph is not None:
            return replace_subgraph(sch, new_module, subgraph, name, concrete_args)
        given = [k for k, v in (("name", name), ("concrete_args", concrete_args)) if v is not None]
        if given:
            raise PrimitiveError(
                f'replace on "{label(sch.path)}": {" and ".join(given)} only apply when replacing '
                "a subgraph: replace(new_module, sch.find(pattern), ...)"
            )
        if new_module is sch.mod:
            raise PrimitiveError(f'replace on "{label(sch.path)}" got the module it already has')
        move_hooks(sch.mod, new_module)
        sch.swap_module(new_module)
        return None
