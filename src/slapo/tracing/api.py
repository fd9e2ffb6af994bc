"""The entry points: trace one module with torch.export or torch.fx, then make it mode-aware
and give it back the original parameters, buffers and train/eval flags."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch import fx, nn

from ..logger import get_logger
from ..surgery import label
from .capture import call_args, with_concrete_args
from .errors import TraceError
from .export import export_module
from .fx import fx_trace
from .inline import inline_submodules
from .keep import keep_attributes, keep_state
from .leaves import Leaves, check_leaves
from .names import mark_dynamo_names
from .retrace import install_retrace
from .rewrite import make_mode_aware

__all__ = ["TRACERS", "resolve_tracer", "trace", "trace_module"]


# Tracer names: Slapo's own ("pytorch", "huggingface", "dynamo") beside torch's ("fx", "export").
# None (the default) and "auto" choose by need. "fx" is plain symbolic tracing, then the Hugging
# Face-aware fx tracer (hf_fx.py: transformers blocks, no inputs needed) where plain fx fails;
# "huggingface" ("hf") is that too, then torch.export where both fail. "dynamo" is torch.export
# (dynamo's successor: today's dynamo inlines module calls, so no module would stay a call),
# and its graphs' module calls also answer to dynamo's names (names.py: "self_query").
TRACERS: dict[str, str] = {
    "auto": "auto",
    "fx": "fx",
    "pytorch": "fx",
    "huggingface": "hf",
    "export": "export",
    "dynamo": "export",
}


def resolve_tracer(tracer: str | None, example_inputs: Any = None, path: str = "") -> str:
    """The tracing method for ``tracer``: ``"fx"``, ``"export"`` or ``"auto"`` (fx first, then
    torch.export). ``None`` is ``"export"`` when example inputs are given, else ``"auto"``.

    Example:
        >>> resolve_tracer("pytorch"), resolve_tracer("dynamo"), resolve_tracer(None)
        ('fx', 'export', 'auto')
    """
    if tracer is None:
        return "auto" if example_inputs is None else "export"
    if not isinstance(tracer, str) or tracer.lower() not in TRACERS:
        raise TraceError(
            f'trace of "{label(path)}": unknown tracer {tracer!r}; the tracers are '
            f"{', '.join(repr(t) for t in TRACERS)} (or None to choose by need)"
        )
    return TRACERS[tracer.lower()]


def trace_module(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    leaves: Leaves = (),
    flatten: bool = False,
    tracer: str | None = None,
    concrete_args: dict[str, Any] | None = None,
    recursive: bool = True,
    leaf_modules: Leaves | None = None,
    config: Any = None,
    path: str = "",
    infer_inputs: Callable[[], Any] | None = None,
) -> fx.GraphModule:
    """Trace ``mod`` into a ``torch.fx.GraphModule`` that keeps its submodule hierarchy.

    Args:
        model: the module to trace.
        example_inputs: what ``mod`` is called with: a tensor, a tuple of positional arguments,
            a dict of keyword arguments, or ``(args_tuple, kwargs_dict)`` wrapped as
            ``{"args": ..., "kwargs": ...}``. Given, the default tracer is torch.export.
        leaves: submodules kept as calls of the original module (paths, regexes, class names or
            classes). fx does not trace into them; torch.export still traces through them (they
            must be exportable) but keeps the original module object and call signature.
        flatten: inline traced submodules into one graph (leaves stay calls).
        tracer: None or ``"auto"`` (default: torch.export when ``example_inputs`` are given;
            otherwise fx, which needs no inputs, then torch.export on captured inputs where fx
            fails, or the Hugging Face-aware fx tracer where no inputs are at hand),
            ``"fx"``/``"pytorch"`` (symbolic tracing, then the Hugging Face-aware fx tracer of
            :mod:`slapo.tracing.hf_fx`, which traces transformers blocks without inputs),
            ``"huggingface"`` (both fx tracers, then torch.export), ``"export"``/``"dynamo"``
            (torch.export; with ``"dynamo"``, a module call also matches a ``find`` regex by
            dynamo's name of it, ``self_query`` for ``query``: see :mod:`slapo.tracing.names`).
        concrete_args: passed to fx symbolic tracing; the Hugging Face-aware tracer fixes the
            named arguments to them (a tensor there is an input traced with its shape) and
            ``**kwargs`` entries too. torch.export (``tracer="export"``/``"dynamo"``) traces the
            example call with those arguments set to them (``**kwargs`` entries too; a value
            ``inspect.Parameter.empty`` leaves the argument as captured); where fx fails under
            another tracer, torch.export traces without them (it fixes every non-tensor input to
            the captured value anyway).
        recursive: ``False`` keeps every direct child a leaf: only this module's own forward
            is traced (so ``flatten`` has nothing to inline). Slapo's option of that name.
        leaf_modules: Slapo's name for ``leaves``; the two lists are joined.
        config: the model config: the Hugging Face-aware fx tracer sizes its synthesized
            (meta) inputs from it (``hidden_size``, ``head_dim``); else from the module's own
            ``config`` or first layer.
        path: the module's path, used in error messages and in the log.
        infer_inputs: called for example inputs when torch.export needs some and none were
            given (the schedule captures them from the root's); else ``mod.dummy_inputs``.

    Layers made by ``decompose`` are inlined into the graph of their caller, so that their
    bias add can be matched with what follows it. One INFO line is logged per trace.

    A call unlike the traced one (another length of a dimension an exported graph fixed, an
    optional argument given or left out unlike the capture, None for an argument an fx graph
    reads) traces ``model`` again for that call, while the graph is not edited; see
    :mod:`slapo.tracing.retrace`.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        >>> gm = trace_module(mlp)  # fx: no inputs needed
        >>> isinstance(gm, fx.GraphModule), sorted(n for n, _ in gm.named_children())[:3]
        (True, ['0', '1', '2'])
    """
    mod = model  # the reference API names the argument ``model``: trace_module(model=...)
    method = resolve_tracer(tracer, example_inputs, path)
    check_leaves(mod, leaves, path)
    if leaf_modules is not None:
        check_leaves(mod, leaf_modules, path)
        leaves = [*leaves, *leaf_modules]
    if not recursive:  # every direct child stays a call of the original module
        leaves = [*leaves, *(re.escape(name) for name, _ in mod.named_children())]
    gm, used = _trace_once(
        mod, method, example_inputs, leaves, flatten, concrete_args, path, infer_inputs, config
    )

    def again(
        orig: nn.Module, method: str, inputs: Any, concrete: dict[str, Any] | None
    ) -> fx.GraphModule:
        # fx again means plain fx (the retrace falls back to export on the call's inputs): the
        # Hugging Face-aware tracer would synthesize inputs unlike the call's.
        method = "plain-fx" if method == "fx" else method
        return _trace_once(orig, method, inputs, leaves, flatten, concrete, path, None, config)[0]

    install_retrace(gm, mod, used, again, concrete_args, path)
    if isinstance(tracer, str) and tracer.lower() == "dynamo":
        mark_dynamo_names(gm)
    return gm


def _trace_once(
    mod: nn.Module,
    method: str,
    example_inputs: Any,
    leaves: Leaves,
    flatten: bool,
    concrete_args: dict[str, Any] | None,
    path: str,
    infer_inputs: Callable[[], Any] | None,
    config: Any = None,
) -> tuple[fx.GraphModule, str]:
    """One trace of ``mod`` (see :func:`trace_module`); returns the graph and the tracer used
    (``"fx"``, ``"hf"``: the Hugging Face-aware fx tracer, or ``"export"``)."""
    start = time.perf_counter()
    inline = [n for n, m in mod.named_modules() if getattr(m, "_slapo_inline_when_traced", False)]
    with _train_mode(mod):
        used, gm, fallback = _capture(
            mod, method, example_inputs, leaves, flatten, concrete_args, path, infer_inputs, config
        )
        for sub in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
            make_mode_aware(sub)
        if flatten and used == "export":  # the fx path traced one graph already
            inline_submodules(gm, leaves)
            gm.delete_all_unused_submodules()
        elif inline:
            inline_submodules(gm, leaves, only=inline)
    _repoint_state(gm, mod)
    keep_state(gm, mod)  # also what the captured call did not use (cross-attention)
    keep_attributes(gm, mod)  # what callers read on the module (attention_type, layer_idx)
    _restore_modes(mod, gm)
    get_logger().info(
        'traced "%s" (%s) with %s in %.2f s%s',
        label(path),
        type(mod).__name__,
        _USED[used],
        time.perf_counter() - start,
        f" (fx could not: {_short(fallback)})" if fallback else "",
    )
    return gm, used


_USED = {"fx": "torch.fx", "hf": "torch.fx (Hugging Face-aware)", "export": "torch.export"}


def _capture(
    mod: nn.Module,
    method: str,
    example_inputs: Any,
    leaves: Leaves,
    flatten: bool,
    concrete_args: dict[str, Any] | None,
    path: str,
    infer_inputs: Callable[[], Any] | None,
    config: Any = None,
) -> tuple[str, fx.GraphModule, str]:
    """Trace with ``method``; returns the tracer used, the graph, and why fx failed (if so).

    ``"fx"``: plain fx, then the Hugging Face-aware fx tracer. ``"hf"``: both, then
    torch.export. ``"auto"``: plain fx, then torch.export where inputs are at hand (given,
    captured from the root's or ``dummy_inputs``), else the Hugging Face-aware fx tracer."""
    if method == "export":
        if example_inputs is None:
            example_inputs = _find_inputs(mod, path, infer_inputs)
        args, kwargs = with_concrete_args(mod, *call_args(example_inputs), concrete_args, path)
        return "export", export_module(mod, args, kwargs, leaves, path), ""
    if method == "plain-fx":
        return "fx", fx_trace(mod, leaves, flatten, concrete_args, path), ""
    try:
        return "fx", fx_trace(mod, leaves, flatten, concrete_args, path), ""
    except TraceError as exc:
        fx_reason = _reason(exc)
    reasons = {"fx": fx_reason}
    if method in ("fx", "hf"):
        try:
            return "hf", _hf_trace(mod, leaves, flatten, concrete_args, path, config), fx_reason
        except TraceError as exc:
            reasons["Hugging Face-aware fx"] = _reason(exc)
            if method == "fx":
                raise
    no_inputs = False
    try:
        if example_inputs is None:  # concrete_args are for fx only: export fixes non-tensors
            try:
                example_inputs = _find_inputs(mod, path, infer_inputs)
            except TraceError:
                no_inputs = True
                raise
        args, kwargs = call_args(example_inputs)
        return "export", export_module(mod, args, kwargs, leaves, path), fx_reason
    except TraceError as exc:
        reasons["torch.export"] = _reason(exc)
    if method == "auto" and no_inputs:  # fx with synthesized meta inputs instead
        try:
            return "hf", _hf_trace(mod, leaves, flatten, concrete_args, path, config), fx_reason
        except TraceError as exc:
            reasons["Hugging Face-aware fx"] = _reason(exc)
    shown = "".join(f"\n  {name}: {why}" for name, why in reasons.items())
    raise TraceError(
        f'cannot trace "{label(path)}" ({type(mod).__name__}) with fx nor with torch.export:'
        + shown
    )


def _hf_trace(
    mod: nn.Module,
    leaves: Leaves,
    flatten: bool,
    concrete_args: dict[str, Any] | None,
    path: str,
    config: Any,
) -> fx.GraphModule:
    return fx_trace(mod, leaves, flatten, concrete_args, path, hf=True, config=config)


def _find_inputs(mod: nn.Module, path: str, infer_inputs: Callable[[], Any] | None) -> Any:
    if infer_inputs is not None:
        return infer_inputs()
    dummy = getattr(mod, "dummy_inputs", None)
    if dummy is not None:
        return dict(dummy) if isinstance(dummy, dict) else dummy
    raise TraceError(
        f'tracing "{label(path)}" with torch.export needs example inputs: pass '
        "example_inputs=..., or use tracer='fx'"
    )


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reason(exc: TraceError) -> str:
    """The message of ``exc`` on one line, without the "cannot trace <module> with <x>:" head."""
    text = " ".join(str(exc).split())
    head = re.match(r'cannot trace "[^"]*" \([^)]*\) with \w+: ', text)
    return text[head.end() :] if head else text


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
