"""``trace``: capture this module as a static graph (trace by need)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx, nn

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

__all__ = ["TracePrimitive", "trace_schedule", "traced_by_need"]


def trace_schedule(
    sch: Schedule,
    example_inputs: Any = None,
    *,
    leaves: Leaves = (),
    flatten: bool = False,
    tracer: str | None = None,
    concrete_args: dict[str, Any] | None = None,
    recursive: bool = True,
    leaf_modules: Leaves | None = None,
    config: Any = None,
) -> fx.GraphModule:
    """Trace the module of schedule ``sch`` in place and rebuild its child schedules.

    With no tracer named, ``example_inputs`` given means torch.export; none given means fx
    (no inputs needed), then torch.export where fx fails. Inputs for torch.export are, in
    order: ``example_inputs`` for this module; captured from a run of the root model on
    ``sch.root.extra["example_inputs"]`` or, for ``transformers`` models, their
    ``dummy_inputs``. An already traced module is only flattened if asked.

    Example:
        >>> import slapo
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        >>> gm = trace_schedule(sch, torch.randn(2, 4))
        >>> sch["0"].mod is gm.get_submodule("0")
        True
    """
    mod = sch.mod
    if isinstance(mod, fx.GraphModule):
        if leaf_modules is not None:
            check_leaves(mod, leaf_modules, sch.path)
            leaves = [*leaves, *leaf_modules]
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
    gm = trace_module(
        mod,
        example_inputs,
        leaves=leaves,
        flatten=flatten,
        tracer=tracer,
        concrete_args=concrete_args,
        recursive=recursive,
        leaf_modules=leaf_modules,
        config=config,
        path=sch.path,
        infer_inputs=lambda: _infer_inputs(sch),
    )
    move_hooks(mod, gm)
    sch.swap_module(gm)
    return gm


def traced_by_need(sch: Schedule, primitive: str) -> fx.GraphModule:
    """The schedule's module as a ``GraphModule``: traced now (the default tracer, hierarchy
    kept) if it is not yet. Static-graph primitives call this, so no ``trace()`` is needed.

    Example:
        >>> import slapo
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        >>> type(traced_by_need(sch, "find")).__name__
        'Sequential'
    """
    if isinstance(sch.mod, fx.GraphModule):
        return sch.mod
    wraps = forward_wraps(sch.mod)
    if wraps:
        raise TraceError(
            f'{primitive} on "{label(sch.path)}" needs a static graph, but {", ".join(wraps)}() '
            f"is applied to it already; call {primitive} (or trace()) before {wraps[0]}()"
        )
    return trace_schedule(sch)


def _infer_inputs(sch: Schedule) -> Any:
    root = sch.root
    root_inputs = root.extra.get("example_inputs")
    if root_inputs is None:
        root_inputs = _dummy_inputs(root.mod, sch.path)
        root_inputs = copy.copy(root_inputs) if isinstance(root_inputs, dict) else root_inputs
    if root_inputs is None:
        raise TraceError(
            f'tracing "{label(sch.path)}" with torch.export needs example inputs: pass '
            "trace(example_inputs=...), create_schedule(model, example_inputs=...) for the whole "
            "model, or tracer='fx'"
        )
    if sch.parent is None:
        args, kwargs = as_args(root_inputs)
        return {"args": args, "kwargs": kwargs}
    try:
        try:
            args, kwargs = capture_inputs(root.mod, sch.mod, root_inputs)
        except RuntimeError:
            fitted = _rows_per_codebook(root.mod, root_inputs)
            if fitted is None:
                raise
            args, kwargs = capture_inputs(root.mod, sch.mod, fitted)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001  (the model's own error, re-raised typed)
        raise TraceError(
            f'tracing "{label(sch.path)}": running the model on its example inputs to capture '
            f"this module's inputs failed ({type(exc).__name__}: {exc}); pass "
            "create_schedule(model, example_inputs=...) or trace(example_inputs=...)"
        ) from exc
    return {"args": args, "kwargs": kwargs}


def _rows_per_codebook(model: nn.Module, inputs: Any) -> Any:
    """``dummy_inputs`` whose ``input_ids`` rows are a multiple of the model's audio codebooks
    (MusicGen takes ``batch x codebooks`` rows; transformers' dummy batch has 3); None when the
    model has no codebooks or the rows fit already."""
    config = getattr(model, "config", None)
    books = getattr(config, "num_codebooks", None)
    books = books or getattr(getattr(config, "decoder", None), "num_codebooks", None)
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
    if not isinstance(books, int) or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    if ids.shape[0] % books == 0:
        return None
    rows = ids.repeat(books, 1)  # every original row, once per codebook
    return {**inputs, "input_ids": rows}


def _dummy_inputs(model: nn.Module, path: str) -> Any:
    """A transformers model's ``dummy_inputs``; where the model's own override fails (BART's
    needs a pad token), those of its ``PreTrainedModel`` base (token ids only)."""
    try:
        return getattr(model, "dummy_inputs", None)
    except Exception as exc:  # noqa: BLE001  (the model's own property)
        try:
            return _base_dummy_inputs(model)
        except Exception:  # noqa: BLE001  (reported with the first error)
            pass
        raise TraceError(
            f'tracing "{label(path)}" with torch.export needs example inputs, and the model\'s '
            f"dummy_inputs failed ({type(exc).__name__}: {exc}); pass "
            "create_schedule(model, example_inputs=...) or trace(example_inputs=...)"
        ) from exc


def _base_dummy_inputs(model: nn.Module) -> Any:
    """``dummy_inputs`` as transformers' ``PreTrainedModel`` defines it, for ``model``."""
    for cls in type(model).__mro__:
        prop = cls.__dict__.get("dummy_inputs") if cls.__name__ == "PreTrainedModel" else None
        if isinstance(prop, property) and prop.fget is not None:
            return prop.fget(model)
    raise LookupError("no PreTrainedModel base")


@register_primitive()
class TracePrimitive(Primitive):
    """Turn this module into a ``torch.fx.GraphModule``; its children stay schedulable.

    ``trace(leaves, flatten)``: ``leaves`` are kept as calls of the original submodules and
    ``flatten=True`` inlines traced submodules into one graph. With no ``tracer`` named, fx
    (symbolic tracing, no inputs needed) is tried first and torch.export where fx fails (as on
    transformers layers); ``example_inputs=`` given selects torch.export. torch.export's inputs
    are otherwise captured by running the root model on
    ``create_schedule(model, example_inputs=...)`` or on a transformers model's
    ``dummy_inputs``. ``tracer``: ``"fx"``/``"pytorch"``, ``"export"``/``"dynamo"``,
    ``"huggingface"`` or ``"auto"`` (both: fx first). Slapo's options are accepted too:
    ``leaf_modules`` (joined to ``leaves``), ``recursive=False`` (direct children stay leaves:
    only this module's forward is traced), ``concrete_args`` (fx fixes those arguments; torch.export
    traces the example call with them set) and ``config`` (sizes the Hugging Face-aware fx
    tracer's synthesized inputs). With ``tracer="dynamo"``, ``find`` also knows each module call
    by dynamo's name of it (``self_query`` for ``query``). Dropout keeps following
    ``train()``/``eval()``. ``find``, ``fuse``, partial ``replace``/``checkpoint`` trace by need.

    The traced module keeps every parameter, buffer and plain attribute of the original. A graph
    exported on captured inputs checks each call: another size of a dimension it fixed (a loop
    over the sequence), an optional argument given that was None (or left out that was given),
    another value of a non-tensor argument make it trace the original module again for that
    call (kept per signature, at most eight, with the same parameter objects); an fx graph does
    so for None passed to an optional argument it reads. Once the graph is edited (``fuse``,
    ``replace``, ``checkpoint`` of a subgraph, ``decompose``, sharding), such a call raises
    ``TraceSignatureError`` naming the module and the argument instead; trace on inputs like
    the training batch (``create_schedule(model, example_inputs=batch)``) to fix the shapes and
    arguments it is traced for. A module that keeps state on itself or has a custom backward is
    refused (``TraceEquivalenceError``).

    Example:
        >>> import slapo
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
        >>> gm = sch.trace()  # fx: no inputs needed
        >>> type(sch["0"].mod).__name__, sch["0"].mod is gm.get_submodule("0")
        ('Linear', True)
    """

    name = "trace"

    @staticmethod
    def apply(
        sch: Schedule,
        leaves: Leaves = (),
        flatten: bool = False,
        tracer: str | None = None,
        concrete_args: dict[str, Any] | None = None,
        example_inputs: Any = None,
        recursive: bool = True,
        leaf_modules: Leaves | None = None,
        config: Any = None,
    ) -> fx.GraphModule:
        return trace_schedule(
            sch,
            example_inputs,
            leaves=leaves,
            flatten=flatten,
            tracer=tracer,
            concrete_args=concrete_args,
            recursive=recursive,
            leaf_modules=leaf_modules,
            config=config,
        )
