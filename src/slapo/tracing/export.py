"""The torch.export path: export one module on example inputs, then unflatten the program back
into a hierarchy of ``GraphModule``s named after the original classes."""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.export import Dim, export, unflatten
from torch.utils import _pytree as pytree

from ..logger import get_logger
from ..surgery import label, set_submodule
from .effects import Effects, watch_effects
from .errors import TraceEquivalenceError, TraceError, module_stack, raise_trace_error
from .guard import install_guard
from .keep import keep_state
from .leaves import Leaves, is_leaf
from .verify import _hooked, _same_on, pin_unsound_dims

__all__ = ["ORIGIN", "export_module", "is_cache", "original_of"]

ORIGIN = "_slapo_origin"  # a rebuilt GraphModule's attribute: the module it was traced from


class _Origin:
    """Holds the module a rebuilt ``GraphModule`` was traced from, set only where that module
    had meta tensors: materializing initializes the rebuilt module through it (an init
    function dispatches on the original class, ``nn.Linear``, which a GraphModule is not).

    Not a module attribute (no state_dict keys, no child); a deep copy copies the original (its
    tensors with the graph's, through the memo); pickling drops it (as it drops the retracer).
    """

    __slots__ = ("module",)

    def __init__(self, module: nn.Module | None) -> None:
        self.module = module

    def __deepcopy__(self, memo: dict[int, Any]) -> _Origin:
        return _Origin(copy.deepcopy(self.module, memo))

    def __reduce__(self) -> tuple[type, tuple[None]]:
        return _Origin, (None,)

    def __repr__(self) -> str:
        return f"_Origin({type(self.module).__name__})"


def original_of(module: nn.Module) -> nn.Module | None:
    """The module that ``module`` (a GraphModule torch.export rebuilt on meta) was traced
    from, or None.

    Example:
        >>> original_of(nn.Linear(2, 2)) is None
        True
    """
    held = module.__dict__.get(ORIGIN)
    return held.module if isinstance(held, _Origin) else None


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers KV cache (not a pytree container; training never
    needs one, so tracing replaces it by None).

    Example:
        >>> is_cache(torch.zeros(1)), is_cache(None)
        (False, False)
    """
    return type(value).__name__.endswith("Cache") and not isinstance(value, torch.Tensor)


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


def export_module(
    mod: nn.Module, args: tuple, kwargs: dict[str, Any], leaves: Leaves, path: str
) -> fx.GraphModule:
    """Export ``mod`` called with ``(args, kwargs)``; ``leaves`` stay calls of the original
    modules. Every input dimension may vary; KV caches are None in the graph and at runtime.
    Dimensions and arguments export fixes are checked at each call (``guard``); submodules
    whose calls a graph cannot replay stay leaves (``effects``).

    Example:
        >>> gm = export_module(nn.Sequential(nn.Linear(2, 2)), (torch.randn(3, 2),), {}, (), "")
        >>> type(gm).__name__
        'Sequential'
    """
    leaf_paths = _outermost([n for n, m in mod.named_modules() if n and is_leaf(n, m, leaves)])
    traced_args = tuple(None if is_cache(a) else a for a in args)
    traced_kwargs = {k: None if is_cache(v) else v for k, v in kwargs.items()}
    flat, spec = pytree.tree_flatten((traced_args, traced_kwargs))
    tensors = tuple(t for t in flat if isinstance(t, torch.Tensor))
    wrapper = _Wrapper(mod, flat, spec)
    ep, leaf_paths = _export_faithfully(wrapper, tensors, leaf_paths, path)
    failed: TraceError | None = None
    for _ in range(3):  # a submodule unflatten cannot rebuild is kept as a call (a leaf)
        try:
            gm = _rebuild(ep, mod, leaf_paths, path)
            break
        except TraceError as exc:
            more = [] if _hooked(mod) else _unrebuildable(mod, exc.__cause__, leaf_paths)
            if not more:
                raise
            failed = failed or exc
            get_logger().info(
                'kept %s of "%s" as calls of the original modules: torch.export cannot rebuild '
                "them as modules (%s)",
                ", ".join(more),
                label(path),
                exc.__cause__,
            )
            ep, leaf_paths = _export_faithfully(
                wrapper, tensors, _outermost([*leaf_paths, *more]), path
            )
    else:
        gm = _rebuild(ep, mod, leaf_paths, path)
    if failed is not None:
        keep_state(gm, mod)  # what the call did not use, as trace_module puts back anyway
    if failed is not None and not _same_on(gm, mod, (traced_args, traced_kwargs)):
        raise TraceError(
            f"{failed} Keeping the submodules it names as calls gives a graph that does not "
            "compute what the module does on the captured call (the module may call them by "
            "other methods than forward)."
        ) from failed
    # The graph holds for calls like the captured one only: check each call (see guard.py).
    guard = install_guard(gm, mod, traced_args, traced_kwargs, ep, path)
    if guard and pin_unsound_dims(gm, mod, traced_args, traced_kwargs, guard):
        get_logger().info(
            '"%s" (%s): its graph differs from the module at other sizes than the traced ones; '
            "other sizes raise TraceSignatureError",
            label(path),
            type(mod).__name__,
        )
    _drop_caches_at_runtime(gm, _cache_arg_names(gm, args, kwargs))
    return gm


def _unrebuildable(mod: nn.Module, cause: BaseException | None, leaf_paths: list[str]) -> list[str]:
    """The submodules of ``mod`` that unflatten failed on, from its ``'X' object has no
    attribute 'y'`` (a module reached by a data-dependent key or an attribute of a module it
    does not rebuild): the modules of class X that have ``y`` (the owner of a ModuleDict or
    ModuleList), not yet leaves."""
    found = re.search(r"'(\w+)' object has no attribute '(\w+)'", str(cause or ""))
    if not isinstance(cause, AttributeError) or found is None:
        return []
    cls, attr = found.groups()
    paths = []
    for p, m in mod.named_modules():
        if not p or type(m).__name__ != cls or not hasattr(m, attr):
            continue
        if isinstance(m, nn.ModuleDict | nn.ModuleList):  # not called: its owner is
            p = p.rpartition(".")[0]
        if p and not _covered(p, leaf_paths):
            paths.append(p)
    return _outermost(sorted(set(paths)))


def _rebuild(
    ep: torch.export.ExportedProgram, mod: nn.Module, leaf_paths: list[str], path: str
) -> nn.Module:
    """The exported program as a hierarchy of GraphModules named after ``mod``'s classes, the
    leaves the original modules."""
    try:
        with _quiet():
            unflat = unflatten(ep)
        top = unflat.get_submodule("m")
        for p in leaf_paths:  # signature preserved: the original module can be called as it was
            set_submodule(top, p, mod.get_submodule(p))
            _fix_leaf_calls(top, p)
        return _to_graph_modules(top, mod)
    except Exception as exc:  # noqa: BLE001  (torch's unflatten failed: re-raised typed)
        raise TraceError(
            f'cannot trace "{label(path)}" ({type(mod).__name__}) with export: the exported '
            f"program cannot be rebuilt as modules ({type(exc).__name__}: {exc}). Mark the "
            "submodule named there as a leaf (leaves=[...]) or trace its submodules instead."
        ) from exc


def _export_faithfully(
    wrapper: _Wrapper, tensors: tuple[torch.Tensor, ...], leaf_paths: list[str], path: str
) -> tuple[torch.export.ExportedProgram, list[str]]:
    """Export, keeping as calls of the original modules (leaves) the submodules that keep state
    on themselves or call a custom autograd.Function (a graph would not replay either); refuse
    where the module itself does. Returns the program and the leaves it was exported with."""
    ep, effects = _export(wrapper, tensors, leaf_paths, path)
    auto = _outermost(sorted(effects.runners()))
    uncovered = [p for p in auto if not _covered(p, leaf_paths)]
    if uncovered and "" not in uncovered:
        get_logger().info(
            'kept %s of "%s" as calls of the original modules: %s',
            ", ".join(uncovered),
            label(path),
            "; ".join(f"{p} {effects.describe(p)}" for p in uncovered),
        )
        leaf_paths = _outermost([*leaf_paths, *uncovered])
        ep, effects = _export(wrapper, tensors, leaf_paths, path)
    _refuse_effects(wrapper.m, effects, leaf_paths, path)
    return ep, leaf_paths


def _export(
    wrapper: _Wrapper, tensors: tuple[torch.Tensor, ...], leaf_paths: list[str], path: str
) -> tuple[torch.export.ExportedProgram, Effects]:
    """torch.export of ``wrapper`` on ``tensors``, and what the module did that a graph cannot."""
    mod = wrapper.m
    # Every dimension may vary (batch, sequence); export keeps the ones the code fixes.
    dims = tuple({i: Dim.AUTO for i in range(t.dim())} for t in tensors)
    preserve = ("m", *(f"m.{p}" for p in leaf_paths))
    with module_stack(mod) as stack, _quiet(), watch_effects(mod, stack) as effects:
        try:
            ep = export(
                wrapper,
                tensors,
                strict=False,
                dynamic_shapes={"tensors": dims},
                preserve_module_call_signature=preserve,
            )
        except Exception as exc:  # noqa: BLE001  (re-raised with the module named)
            raise_trace_error(path, mod, "export", exc, stack[-1] if stack else "")
    return ep, effects


def _outermost(paths: list[str]) -> list[str]:
    """``paths`` without those inside another one (a leaf's submodules run with it)."""
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths if q)]


def _covered(path: str, leaf_paths: list[str]) -> bool:
    return any(path == q or path.startswith(q + ".") for q in leaf_paths)


def _refuse_effects(mod: nn.Module, effects: Effects, leaf_paths: list[str], path: str) -> None:
    """Raise where what the graph would drop is done outside every leaf (by the module itself)."""
    bad = [p for p in sorted(effects.runners()) if not _covered(p, leaf_paths)]
    if not bad:
        return
    what = "; ".join(f"{f'submodule {p!r}' if p else 'it'} {effects.describe(p)}" for p in bad)
    raise TraceEquivalenceError(
        f'cannot trace "{label(path)}" ({type(mod).__name__}) into a graph that computes what it '
        f"does: {what}. A graph would not replay that; trace its submodules instead, or keep it "
        "as it is."
    )


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
            for a in (*node.args, *node.kwargs.values())  # kwargs-free calls pass args only
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
    gm = fx.GraphModule(interp, interp.graph, class_name=name)
    if orig is not None and _has_meta(orig):  # real ones need no init: keep nothing alive
        gm.__dict__[ORIGIN] = _Origin(orig)
    return gm


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _cache_arg_names(gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> set[str]:
    names = {k for k, v in kwargs.items() if is_cache(v)}
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    names |= {placeholders[i] for i, a in enumerate(args) if is_cache(a) and i < len(placeholders)}
    return names


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
    return None if is_cache(value) else value
