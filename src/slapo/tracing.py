"""Graph capture of one module subtree: torch.export first, torch.fx with leaves second.

Slapo traces by need: only the module a static-graph primitive works on becomes a
``torch.fx.GraphModule``. With ``flatten=False`` the hierarchy is kept: every submodule that was
traced through becomes a ``GraphModule`` of its own under the same name, so the schedule tree (and
paths such as ``"mlp.down_proj"``) stays the same. Parameters and buffers stay the very same
objects, so optimizers, tied weights and checkpoints are unaffected.

Mode-dependent operations are made mode-aware after capture: dropout (functional or not) and the
dropout probability of scaled-dot-product attention follow ``module.train()``/``eval()`` as in
the untraced module, although tracing always runs in training mode.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import logging
import operator
import re
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils import _pytree as pytree

from .exceptions import SlapoError

__all__ = [
    "TraceError",
    "LeafError",
    "trace",
    "trace_module",
    "trace_schedule",
    "capture_inputs",
    "inline_submodules",
    "ModeDropout",
    "TrainingOnly",
]

Leaves = Sequence[str | type]


class TraceError(SlapoError, RuntimeError):
    """A module could not be captured as a static graph."""


class LeafError(TraceError, ValueError):
    """A ``leaves=`` entry that names no submodule of the traced module, or is not a name."""


class ModeDropout(nn.Module):
    """Dropout with probability ``p`` that follows the owning module's train/eval mode.

    Tracing bakes ``F.dropout(x, p, self.training)`` into a constant; the trace replaces such
    calls with this module so ``model.eval()`` still switches dropout off.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class TrainingOnly(nn.Module):
    """Return ``value`` in training mode and ``0.0`` in eval mode (e.g. attention dropout_p)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self) -> float:
        return self.value if self.training else 0.0

    def extra_repr(self) -> str:
        return f"value={self.value}"


# ----- example inputs --------------------------------------------------------------------------
class _Captured(Exception):
    """Stops the capture run as soon as the target module got its inputs."""


def _is_cache(value: Any) -> bool:
    # transformers KV caches are not pytree containers; training never needs them.
    return type(value).__name__.endswith("Cache") and not isinstance(value, torch.Tensor)


def capture_inputs(
    root: nn.Module, target: nn.Module, root_inputs: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Run ``root`` on ``root_inputs`` and return the ``(args, kwargs)`` ``target`` is called with.

    The run stops at the target's first call, keeps no autograd graph and leaves the global RNG
    state untouched, so a later training step is unaffected.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> args, kwargs = capture_inputs(model, model[1], (torch.randn(2, 4),))
        >>> args[0].shape
        torch.Size([2, 4])
    """
    seen: dict[str, Any] = {}

    def hook(mod: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        seen["args"], seen["kwargs"] = args, kwargs
        raise _Captured

    handle = target.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    args, kwargs = _as_args(root_inputs)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            root(*args, **kwargs)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "args" not in seen:
        raise TraceError(
            f"{type(target).__name__} was never called when running the model on its example "
            "inputs; pass example_inputs= for this module"
        )
    return seen["args"], seen["kwargs"]


def _as_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    if isinstance(inputs, list):
        return tuple(inputs), {}
    return (inputs,), {}


# ----- helpers -------------------------------------------------------------------------------
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


def _matches(leaf: str | type, path: str, mod: nn.Module) -> bool:
    if isinstance(leaf, type):
        return isinstance(mod, leaf)
    return leaf in (path, type(mod).__name__) or re.fullmatch(leaf, path) is not None


def _is_leaf(path: str, mod: nn.Module, leaves: Leaves) -> bool:
    return any(_matches(leaf, path, mod) for leaf in leaves)


def check_leaves(mod: nn.Module, leaves: Leaves, path: str = "") -> None:
    """Raise :class:`LeafError` unless every entry of ``leaves`` can match a submodule of ``mod``.

    A string entry must be a submodule path (relative to ``mod``, or to any of its descendants,
    as the hierarchical fx trace matches at every level), a class name, or a regex that fully
    matches such a path; a class entry needs no submodule (it may be a generic choice).

    Example:
        >>> check_leaves(nn.Sequential(nn.Linear(2, 2)), ["0", "Linear", "[0-9]+", nn.ReLU])
        >>> check_leaves(nn.Sequential(nn.Linear(2, 2)), ["1"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        slapo.tracing.LeafError: trace of "<root>" (Sequential): leaves entry '1' names no ...
    """
    where = f'"{path or "<root>"}" ({type(mod).__name__})'
    if isinstance(leaves, str | type):
        raise LeafError(
            f"trace of {where}: leaves must be a list of module paths, regexes, class names or "
            f"classes, got leaves={leaves!r}; write leaves=[{leaves!r}]"
        )
    named = [(n, m) for n, m in mod.named_modules() if n]
    # Every dotted suffix of every path: "layers.0.attn" is also "0.attn" and "attn" one level
    # down, where the hierarchical fx trace matches leaves again.
    suffixes = {".".join(n.split(".")[i:]) for n, _ in named for i in range(n.count(".") + 1)}
    classes = {type(m).__name__ for _, m in named}
    for leaf in leaves:
        if isinstance(leaf, type):
            continue
        if not isinstance(leaf, str):
            raise LeafError(
                f"trace of {where}: leaves entries are module paths, regexes, class names or "
                f"classes, got a {type(leaf).__name__} object; give its path or its class"
            )
        if leaf in suffixes or leaf in classes:
            continue
        try:
            regex: re.Pattern[str] | None = re.compile(leaf)
            bad_regex = ""
        except re.error as exc:
            regex, bad_regex = None, f" (and not a valid regex: {exc})"
        if regex is not None and any(regex.fullmatch(s) for s in suffixes):
            continue
        close = difflib.get_close_matches(leaf, sorted(suffixes | classes), n=3, cutoff=0.6)
        paths = [n for n, _ in named]
        shown = ", ".join(paths[:12]) + (f", ... {len(paths) - 12} more" if paths[12:] else "")
        raise LeafError(
            f"trace of {where}: leaves entry {leaf!r} names no submodule: it is not a module "
            f"path, a class name, or a regex matching a path{bad_regex}."
            + (f" Did you mean {', '.join(map(repr, close))}?" if close else "")
            + f" Module paths: {shown or '(none)'}. Class names: "
            f"{', '.join(sorted(classes)) or '(none)'}."
        )


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


def _where(exc: BaseException) -> str:
    """The innermost frame of model code (not torch's) where ``exc`` was raised."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if "/torch/" not in f.filename and "/slapo/" not in f.filename
    ]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename.rsplit('/', 2)[-1]}:{f.lineno} `{(f.line or '').strip()}`"


@contextlib.contextmanager
def _module_stack(mod: nn.Module) -> Iterator[list[str]]:
    """Track which submodules are running, to name the innermost one when tracing fails."""
    stack: list[str] = []
    handles = []
    for name, sub in mod.named_modules():
        handles.append(sub.register_forward_pre_hook(lambda m, a, n=name: stack.append(n)))
        handles.append(sub.register_forward_hook(lambda m, a, o: _pop(stack)))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


def _pop(stack: list[str]) -> None:
    # A forward hook must return None, or it would replace the module's output.
    if stack:
        stack.pop()


def _trace_error(path: str, mod: nn.Module, tracer: str, exc: BaseException, inner: str) -> None:
    msg = str(exc).strip().splitlines()
    first = msg[0] if msg else type(exc).__name__
    where = path or "<root>"
    hint = (
        f' The failure is inside submodule "{inner}": trace with tracer="fx", '
        f'leaves=["{inner}"] to keep it as a call, or trace its parent only.'
        if inner
        else " Mark the submodules that cannot be traced as leaves (tracer='fx', leaves=[...])."
    )
    if tracer == "fx" and "co_varnames" in first:
        hint = (
            " fx cannot trace a forward that takes **kwargs (as transformers 5 layers do); "
            "use tracer='export', or pass concrete_args."
        )
    elif tracer == "fx":
        hint += " torch.export (tracer='export') handles data-dependent Python that fx cannot."
    raise TraceError(
        f'cannot trace "{where}" ({type(mod).__name__}) with {tracer}: '
        f"{type(exc).__name__}: {first}{_where(exc)}.{hint}"
    ) from exc


# ----- torch.export ---------------------------------------------------------------------------
class _Wrapper(nn.Module):
    """Calls ``m`` with tensor leaves substituted into the captured argument structure.

    Exporting through a wrapper (with ``m``'s call signature preserved) gives ``m`` a graph that
    takes the original ``(args, kwargs)``; dynamic shapes are easy to state on a flat tuple.
    """

    def __init__(self, m: nn.Module, leaves: list[Any], spec: pytree.TreeSpec) -> None:
        super().__init__()
        self.m = m
        self._leaves = leaves
        self._spec = spec

    def forward(self, *tensors: torch.Tensor) -> Any:
        it = iter(tensors)
        leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in self._leaves]
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        return self.m(*args, **kwargs)


def _export(
    mod: nn.Module, args: tuple, kwargs: dict[str, Any], leaf_paths: list[str], path: str
) -> nn.Module:
    from torch.export import Dim, export, unflatten

    args = tuple(None if _is_cache(a) else a for a in args)
    kwargs = {k: None if _is_cache(v) else v for k, v in kwargs.items()}
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = tuple(t for t in flat if isinstance(t, torch.Tensor))
    # Every dimension may vary (batch, sequence); export keeps the ones the code fixes.
    dims = tuple({i: Dim.AUTO for i in range(t.dim())} for t in tensors)
    wrapper = _Wrapper(mod, flat, spec)
    preserve = ("m", *(f"m.{p}" for p in leaf_paths))
    with _module_stack(mod) as stack, _quiet():
        try:
            ep = export(
                wrapper,
                tensors,
                strict=False,
                dynamic_shapes={"tensors": dims},
                preserve_module_call_signature=preserve,
            )
        except Exception as exc:  # noqa: BLE001  (re-raised with the module named)
            inner = stack[-1] if stack else ""
            _trace_error(path, mod, "export", exc, inner)
    with _quiet():
        unflat = unflatten(ep)
    top = unflat.get_submodule("m")
    for p in leaf_paths:  # signature preserved: the original module can be called as it was
        _set_submodule(top, p, mod.get_submodule(p))
        _fix_leaf_calls(top, p)
    return _to_graph_modules(top, mod)


def _fix_leaf_calls(top: nn.Module, path: str) -> None:
    """Make calls of a preserved leaf pass exactly the original ``(args, kwargs)``.

    unflatten calls a preserved module with its flat graph inputs as positional arguments
    next to the rebuilt keyword arguments; the original module must get the rebuilt ones only.
    """
    owner_path, _, name = path.rpartition(".")
    owner = top.get_submodule(owner_path) if owner_path else top
    graph = owner.graph
    for node in list(graph.nodes):
        if node.op != "call_module" or node.target != name:
            continue
        sources = {
            a.args[0].args[0]
            for a in node.kwargs.values()
            if isinstance(a, fx.Node)
            and a.target is operator.getitem
            and isinstance(a.args[0], fx.Node)
            and a.args[0].target is operator.getitem
        }
        unflat = [
            n for n in sources if n.op == "call_function" and n.target is pytree.tree_unflatten
        ]
        if not unflat:
            continue
        spec = getattr(owner, unflat[0].args[1].target)
        n_pos = spec.child(0).num_children
        with graph.inserting_before(node):
            pos = graph.call_function(operator.getitem, (unflat[0], 0))
            node.args = tuple(graph.call_function(operator.getitem, (pos, i)) for i in range(n_pos))
        if not n_pos:
            graph.erase_node(pos)
    graph.lint()
    if hasattr(owner, "recompile"):
        owner.recompile()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence export's per-dimension notes (0/1 specialization) and deprecation warnings."""
    logger = logging.getLogger("torch._export.non_strict_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    owner, _, name = path.rpartition(".")
    setattr(root.get_submodule(owner) if owner else root, name, new)


def _to_graph_modules(interp: nn.Module, orig: nn.Module | None) -> nn.Module:
    """Turn torch.export's InterpreterModules into GraphModules named after the original class."""
    orig_children = dict(orig.named_children()) if orig is not None else {}
    for name, child in list(interp.named_children()):
        child_orig = orig_children.get(name)
        if child is child_orig or getattr(child, "graph", None) is None:
            continue  # a leaf put back, or a plain container
        setattr(interp, name, _to_graph_modules(child, child_orig))
    if getattr(interp, "graph", None) is None:
        return interp
    for node in interp.graph.nodes:
        if node.name == "self":  # a submodule named "self" (BERT) would shadow the method's self
            node._rename("self_out")
    name = type(orig).__name__ if orig is not None else "GraphModule"
    return fx.GraphModule(interp, interp.graph, class_name=name)


# ----- torch.fx ---------------------------------------------------------------------------------
class _LeafTracer(fx.Tracer):
    def __init__(self, root: nn.Module, leaves: Leaves, children_are_leaves: bool) -> None:
        super().__init__()
        self._paths = {id(m): n for n, m in root.named_modules()}
        self._leaves = leaves
        self._children = {id(m) for m in root.children()} if children_are_leaves else set()

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if id(m) in self._children or _is_leaf(qualname, m, self._leaves):
            return True
        return super().is_leaf_module(m, qualname)


def _fx_trace(
    mod: nn.Module,
    leaves: Leaves,
    flatten: bool,
    concrete_args: dict[str, Any] | None,
    path: str,
) -> fx.GraphModule:
    tracer = _LeafTracer(mod, leaves, children_are_leaves=not flatten)
    with _module_stack(mod) as stack:
        try:
            graph = tracer.trace(mod, concrete_args=concrete_args)
        except Exception as exc:  # noqa: BLE001  (re-raised with the module named)
            _trace_error(path, mod, "fx", exc, stack[-1] if stack else "")
    gm = fx.GraphModule(mod, graph, class_name=type(mod).__name__)
    if flatten:
        return gm
    # Keep the hierarchy: trace every child that is neither a leaf nor a torch.nn built-in.
    for name, child in list(gm.named_children()):
        sub = _join(path, name)
        if _is_leaf(name, child, leaves) or fx.Tracer().is_leaf_module(child, name):
            continue
        if isinstance(child, fx.GraphModule):
            continue
        inner = [_strip(leaf, name) for leaf in leaves]
        setattr(gm, name, _fx_trace(child, inner, False, None, sub))
    return gm


def _strip(leaf: str | type, prefix: str) -> str | type:
    if isinstance(leaf, str) and leaf.startswith(prefix + "."):
        return leaf[len(prefix) + 1 :]
    return leaf


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# ----- post-processing ---------------------------------------------------------------------------
_DROPOUTS = {F.dropout, torch.dropout, torch.ops.aten.dropout.default}
_SDPAS = {F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}


def _arg(node: fx.Node, index: int, name: str, default: Any) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def make_mode_aware(gm: fx.GraphModule) -> int:
    """Replace train-mode dropout baked into ``gm``'s graph by mode-following modules.

    Returns how many nodes were rewritten. Dropout calls become :class:`ModeDropout`; a non-zero
    ``dropout_p`` of scaled-dot-product attention is read from a :class:`TrainingOnly` module.
    """
    count = 0
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _DROPOUTS:
            p = _arg(node, 1, "p", 0.5)
            train = _arg(node, 2, "training" if node.target is F.dropout else "train", True)
            if train is not True or not isinstance(p, float):
                continue
            name = _fresh(gm, "_slapo_dropout")
            gm.add_submodule(name, ModeDropout(p))
            with graph.inserting_before(node):
                new = graph.call_module(name, (node.args[0],))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            count += 1
        elif node.target in _SDPAS:
            p = _arg(node, 4, "dropout_p", 0.0)
            if not isinstance(p, float) or p == 0.0:
                continue
            name = _fresh(gm, "_slapo_attn_dropout_p")
            gm.add_submodule(name, TrainingOnly(p))
            with graph.inserting_before(node):
                flag = graph.call_module(name, ())
            if "dropout_p" in node.kwargs:
                node.update_kwarg("dropout_p", flag)
            else:
                node.update_arg(4, flag)
            count += 1
    if count:
        gm.recompile()
    return count


def _fresh(gm: nn.Module, base: str) -> str:
    i = 0
    while hasattr(gm, f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


def _graph_modules(mod: nn.Module) -> Iterator[fx.GraphModule]:
    for m in mod.modules():
        if isinstance(m, fx.GraphModule):
            yield m


def _drop_caches_at_runtime(gm: fx.GraphModule, cache_args: set[str]) -> None:
    """Runtime KV caches are replaced by None, as they were when the module was traced."""
    if not cache_args:
        return
    for node in list(gm.graph.nodes):
        if node.op == "placeholder" and node.target in cache_args:
            with gm.graph.inserting_after(node):
                new = gm.graph.call_function(_none_if_cache, (node,))
            node.replace_all_uses_with(new, delete_user_cb=lambda u, n=new: u is not n)
    gm.recompile()


def _none_if_cache(value: Any) -> Any:
    return None if _is_cache(value) else value


def inline_submodules(gm: fx.GraphModule, leaves: Leaves = ()) -> fx.GraphModule:
    """Inline every call of a child ``GraphModule`` (recursively) into ``gm``'s own graph.

    Children that are leaves (or not GraphModules) stay calls. Parameters keep their owners and
    paths, so state_dict keys do not change.

    Example:
        >>> gm = trace_module(nn.Sequential(nn.Sequential(nn.Linear(2, 2))), tracer="fx")
        >>> flat = inline_submodules(gm)
    """
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_module":
                continue
            sub = gm.get_submodule(node.target)
            if not isinstance(sub, fx.GraphModule) or _is_leaf(node.target, sub, leaves):
                continue
            _inline_one(gm, node, sub)
            changed = True
    gm.graph.lint()
    gm.recompile()
    return gm


def _inline_one(gm: fx.GraphModule, call: fx.Node, sub: fx.GraphModule) -> None:
    graph = gm.graph
    prefix = call.target
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for i, ph in enumerate(placeholders):
        if i < len(call.args):
            env[ph] = call.args[i]
        elif ph.target in call.kwargs:
            env[ph] = call.kwargs[ph.target]
        else:
            env[ph] = ph.args[0] if ph.args else None
    result: Any = None
    with graph.inserting_before(call):
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                result = fx.node.map_arg(node.args[0], lambda n: env[n])
                continue
            new = graph.node_copy(node, lambda n: env[n])
            if node.op in ("get_attr", "call_module"):
                new.target = f"{prefix}.{node.target}"
            env[node] = new
    if isinstance(result, fx.Node) or result is None:
        call.replace_all_uses_with(result)  # type: ignore[arg-type]
    else:
        # A tuple output: users index into it with getitem; forward them to the element.
        for user in list(call.users):
            if user.op == "call_function" and user.target is _getitem():
                user.replace_all_uses_with(result[user.args[1]])
                graph.erase_node(user)
            else:
                with graph.inserting_before(user):
                    tup = graph.call_function(tuple, (list(result),))
                user.replace_input_with(call, tup)
    graph.erase_node(call)


def _getitem() -> Callable[..., Any]:
    import operator

    return operator.getitem


# ----- entry points -----------------------------------------------------------------------------
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
            gm = _fx_trace(mod, leaves, flatten, concrete_args, path)
        else:
            if example_inputs is None:
                raise TraceError(
                    f'tracing "{path or "<root>"}" with torch.export needs example inputs: pass '
                    "example_inputs=..., or use tracer='fx'"
                )
            if isinstance(example_inputs, dict) and set(example_inputs) == {"args", "kwargs"}:
                args, kwargs = tuple(example_inputs["args"]), dict(example_inputs["kwargs"])
            else:
                args, kwargs = _as_args(example_inputs)
            # Leaves are kept only where no ancestor is a leaf already.
            leaf_paths = [n for n, m in mod.named_modules() if n and _is_leaf(n, m, leaves)]
            leaf_paths = [
                p for p in leaf_paths if not any(p.startswith(q + ".") for q in leaf_paths)
            ]
            gm = _export(mod, args, kwargs, leaf_paths, path)
            caches = _cache_arg_names(gm, args, kwargs)
            _drop_caches_at_runtime(gm, caches)
            for sub in list(_graph_modules(gm)):
                make_mode_aware(sub)
            if flatten:
                inline_submodules(gm, leaves)
                gm.delete_all_unused_submodules()
        if tracer == "fx":
            for sub in list(_graph_modules(gm)):
                make_mode_aware(sub)
    _repoint_state(gm, mod)
    _restore_modes(mod, gm)
    return gm


def _cache_arg_names(gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> set[str]:
    names = {k for k, v in kwargs.items() if _is_cache(v)}
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    names |= {placeholders[i] for i, a in enumerate(args) if _is_cache(a) and i < len(placeholders)}
    return names


def trace(model: nn.Module, **kwargs: Any) -> fx.GraphModule:
    """Trace a model to a GraphModule (alias of :func:`trace_module`).

    Example:
        >>> gm = trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), tracer="fx")
    """
    return trace_module(model, **kwargs)


def trace_schedule(
    sch: Any,
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
    from .primitives.replace import _move_hooks
    from .primitives.wrapping import forward_wraps

    mod = sch.mod
    where = sch.path or "<root>"
    if isinstance(mod, fx.GraphModule):
        check_leaves(mod, leaves, sch.path)
        if flatten:
            inline_submodules(mod, leaves)
            sch.swap_module(mod)
        return mod
    wraps = forward_wraps(mod)
    if wraps:
        raise TraceError(
            f'"{where}" already has {", ".join(wraps)}() applied; trace it first, then apply '
            "them (on the traced module, or on a subgraph)"
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
    _move_hooks(mod, gm)
    sch.swap_module(gm)
    return gm


def _infer_inputs(sch: Any) -> Any:
    root = sch.root
    root_inputs = root.extra.get("example_inputs")
    if root_inputs is None:
        root_inputs = getattr(root.mod, "dummy_inputs", None)
        root_inputs = copy.copy(root_inputs) if isinstance(root_inputs, dict) else root_inputs
    if root_inputs is None:
        raise TraceError(
            f'tracing "{sch.path or "<root>"}" with torch.export needs example inputs: pass '
            "trace(example_inputs=...), create_schedule(model, example_inputs=...) for the whole "
            "model, or tracer='fx'"
        )
    if sch.parent is None:
        args, kwargs = _as_args(root_inputs)
        return {"args": args, "kwargs": kwargs}
    args, kwargs = capture_inputs(root.mod, sch.mod, root_inputs)
    return {"args": args, "kwargs": kwargs}
