"""The entry points: trace one module with torch.export or torch.fx, then make it mode-aware
and give it back the original parameters, buffers and train/eval flags."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import fx, nn

from ..surgery import label
from .capture import call_args
from .errors import TraceError
from .export import export_module
from .fx import fx_trace
from .inline import inline_submodules
from .leaves import Leaves, check_leaves
from .rewrite import make_mode_aware

__all__ = ["trace", "trace_module"]


def trace_module(
    mod: nn.Module,
    example_inputs: Any = None,
    *,
    leaves: Leaves = (),
    flatten: bool = False,
    tracer: str = "export",
    concrete_args: dict[str, Any] | None = None,
    path: str = "",
) -> fx.GraphModule:
    """Trace ``mod`` into a ``torch.fx.GraphModule`` that keeps its submodule hierarchy.

    Args:
        mod: the module to trace.
        example_inputs: what ``mod`` is called with: a tensor, a tuple of positional arguments,
            a dict of keyword arguments, or ``(args_tuple, kwargs_dict)`` wrapped as
            ``{"args": ..., "kwargs": ...}``. Required by ``tracer="export"``.
        leaves: submodules kept as calls of the original module (paths, regexes, class names or
            classes). fx does not trace into them; torch.export still traces through them (they
            must be exportable) but keeps the original module object and call signature.
        flatten: inline traced submodules into one graph (leaves stay calls).
        tracer: ``"export"`` (torch.export; handles transformers blocks) or ``"fx"``
            (symbolic tracing, no inputs needed).
        concrete_args: passed to fx symbolic tracing.
        path: the module's path, used in error messages.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        >>> gm = trace_module(mlp, torch.randn(2, 4))
        >>> isinstance(gm, fx.GraphModule), sorted(n for n, _ in gm.named_children())[:3]
        (True, ['0', '1', '2'])
    """
    if tracer not in ("export", "fx"):
        raise TraceError(f'tracer must be "export" or "fx", got {tracer!r}')
    if tracer == "export" and concrete_args is not None:
        raise TraceError("concrete_args only applies to tracer='fx'")
    check_leaves(mod, leaves, path)
    with _train_mode(mod):
        if tracer == "fx":
            gm = fx_trace(mod, leaves, flatten, concrete_args, path)
        elif example_inputs is None:
            raise TraceError(
                f'tracing "{label(path)}" with torch.export needs example inputs: pass '
                "example_inputs=..., or use tracer='fx'"
            )
        else:
            args, kwargs = call_args(example_inputs)
            gm = export_module(mod, args, kwargs, leaves, path)
        for sub in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
            make_mode_aware(sub)
        if flatten and tracer == "export":  # the fx path traced one graph already
            inline_submodules(gm, leaves)
            gm.delete_all_unused_submodules()
    _repoint_state(gm, mod)
    _restore_modes(mod, gm)
    return gm


def trace(model: nn.Module, **kwargs: Any) -> fx.GraphModule:
    """Trace a model to a GraphModule (alias of :func:`trace_module`).

    Example:
        >>> gm = trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), tracer="fx")
    """
    return trace_module(model, **kwargs)


@contextlib.contextmanager
def _train_mode(mod: nn.Module) -> Iterator[None]:
    """Trace in training mode (so dropout rates are visible), then restore every flag."""
    flags = {name: m.training for name, m in mod.named_modules()}
    mod.train()
    try:
        yield
    finally:
        for name, m in mod.named_modules():
            m.training = flags.get(name, m.training)


def _restore_modes(old: nn.Module, new: nn.Module) -> None:
    flags = {name: m.training for name, m in old.named_modules()}
    top = old.training
    for name, m in new.named_modules():
        m.training = flags.get(name, top)


def _repoint_state(new: nn.Module, old: nn.Module) -> None:
    """Make ``new`` hold the very parameter and buffer objects of ``old`` (same names)."""
    old_params = dict(old.named_parameters(remove_duplicate=False))
    old_buffers = dict(old.named_buffers(remove_duplicate=False))
    for name, _ in list(new.named_parameters(remove_duplicate=False)):
        if name in old_params:
            owner, _, attr = name.rpartition(".")
            setattr(new.get_submodule(owner), attr, old_params[name])
    for name, _ in list(new.named_buffers(remove_duplicate=False)):
        if name in old_buffers:
            owner, _, attr = name.rpartition(".")
            new.get_submodule(owner)._buffers[attr] = old_buffers[name]
