"""``trace``: capture this module as a static graph (trace by need)."""

from __future__ import annotations

import copy
from typing import Any

from torch import fx

from ..schedule import Primitive, Schedule, register_primitive
from ..surgery import forward_wraps, label, move_hooks
from ..tracing import (
    Leaves,
    TraceError,
    as_args,
    capture_inputs,
    check_leaves,
    inline_submodules,
    trace_module,
)

__all__ = ["TracePrimitive", "trace_schedule"]


def trace_schedule(
    sch: Schedule,
    example_inputs: Any = None,
    *,
    leaves: Leaves = (),
    flatten: bool = False,
    tracer: str = "export",
    concrete_args: dict[str, Any] | None = None,
) -> fx.GraphModule:
    """Trace the module of schedule ``sch`` in place and rebuild its child schedules.

    Inputs for torch.export are, in order: ``example_inputs`` for this module; captured from a
    run of the root model on ``sch.root.extra["example_inputs"]`` or, for ``transformers``
    models, their ``dummy_inputs``. An already traced module is only flattened if asked.

    Example:
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        >>> gm = trace_schedule(sch, torch.randn(2, 4))
        >>> sch["0"].mod is gm.get_submodule("0")
        True
    """
    mod = sch.mod
    if isinstance(mod, fx.GraphModule):
        check_leaves(mod, leaves, sch.path)
        if flatten:
            inline_submodules(mod, leaves)
            sch.swap_module(mod)
        return mod
    wraps = forward_wraps(mod)
    if wraps:
        raise TraceError(
            f'"{label(sch.path)}" already has {", ".join(wraps)}() applied; trace it first, then '
            "apply them (on the traced module, or on a subgraph)"
        )
    if example_inputs is None and tracer == "export":
        example_inputs = _infer_inputs(sch)
    gm = trace_module(
        mod,
        example_inputs,
        leaves=leaves,
        flatten=flatten,
        tracer=tracer,
        concrete_args=concrete_args,
        path=sch.path,
    )
    move_hooks(mod, gm)
    sch.swap_module(gm)
    return gm


def _infer_inputs(sch: Schedule) -> Any:
    root = sch.root
    root_inputs = root.extra.get("example_inputs")
    if root_inputs is None:
        root_inputs = getattr(root.mod, "dummy_inputs", None)
        root_inputs = copy.copy(root_inputs) if isinstance(root_inputs, dict) else root_inputs
    if root_inputs is None:
        raise TraceError(
            f'tracing "{label(sch.path)}" with torch.export needs example inputs: pass '
            "trace(example_inputs=...), create_schedule(model, example_inputs=...) for the whole "
            "model, or tracer='fx'"
        )
    if sch.parent is None:
        args, kwargs = as_args(root_inputs)
    else:
        args, kwargs = capture_inputs(root.mod, sch.mod, root_inputs)
    return {"args": args, "kwargs": kwargs}


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
        >>> type(sch["0"].mod).__name__, sch["0"].mod is gm.get_submodule("0")
        ('Linear', True)
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
