"""``trace``: capture this module as a static graph (trace by need)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import fx

from ..tracing import Leaves, trace_schedule
from .base import Primitive, register_primitive

if TYPE_CHECKING:
    from ..schedule import Schedule


@register_primitive()
class TracePrimitive(Primitive):
    """Turn this module into a ``torch.fx.GraphModule``; its children stay schedulable.

    ``tracer="export"`` (default) uses torch.export and needs example inputs: given with
    ``example_inputs=``, or captured by running the root model on
    ``create_schedule(model, example_inputs=...)`` or on a transformers model's ``dummy_inputs``.
    ``tracer="fx"`` uses symbolic tracing with ``leaves`` kept as calls. ``flatten=True`` inlines
    traced submodules into one graph. Dropout keeps following ``train()``/``eval()``.

    Example:
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
        >>> gm = sch.trace(example_inputs=torch.randn(2, 4))
        >>> sch["0"].decompose()
    """

    name = "trace"

    @staticmethod
    def apply(
        sch: Schedule,
        leaves: Leaves = (),
        flatten: bool = False,
        tracer: str = "export",
        concrete_args: dict[str, Any] | None = None,
        example_inputs: Any = None,
    ) -> fx.GraphModule:
        return trace_schedule(
            sch,
            example_inputs,
            leaves=leaves,
            flatten=flatten,
            tracer=tracer,
            concrete_args=concrete_args,
        )
