"""Re-tracing on a new signature: a graph is valid for calls like the one it was traced on (an
exported graph fixes a dimension a loop ran over and which optional arguments were given; an fx
graph assumes every optional argument it reads is given). A call unlike every traced one is
traced again from the original module, for that call's inputs, by the same path (export or fx,
the same leaves, effects and checks), as long as the graph was not edited since it was traced
(no primitive changed its code, submodules, parameters or hooks). The graphs are kept per
signature (at most :data:`MAX_SIGNATURES`) and share the original module's parameters and
buffers, so optimizers and sharding see one set. An edited graph keeps raising
:class:`TraceSignatureError`.

Example:
    >>> from torch import nn
    >>> from slapo.tracing import trace_module
    >>> class Unrolled(nn.Module):
    ...     def forward(self, x):  # a Python loop over the sequence: export unrolls it
    ...         return torch.stack([x[:, i] * i for i in range(x.shape[1])], 1)
    >>> gm = trace_module(Unrolled(), torch.randn(2, 5), tracer="export")
    >>> gm(torch.randn(2, 7)).shape  # traced again for length 7
    torch.Size([2, 7])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..logger import get_logger
from ..surgery import label
from .errors import TraceError, TraceSignatureError
from .guard import SignatureGuard

__all__ = ["MAX_SIGNATURES", "Retracer", "fingerprint", "install_retrace", "optional_reads"]

MAX_SIGNATURES = 8  # graphs traced again per module, beyond the first
_ATTR = "_slapo_retrace"

# (the original module, "fx" or "export", example inputs or None, concrete args or None)
TraceOnce = Callable[[nn.Module, str, Any, "dict[str, Any] | None"], fx.GraphModule]


def fingerprint(gm: nn.Module) -> tuple[Any, ...]:
    """What a graph-editing primitive changes: each submodule (object, class, graph code, forward
    wrappers, hooks), each parameter and buffer (object and shape). The root's own hooks and
    forward attribute are left out (hooks run around every graph alike), not its class (a
    wrapped forward, as checkpoint makes, is a new class).

    Example:
        >>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
        >>> before = fingerprint(gm)
        >>> gm.graph.call_function(torch.relu, (next(iter(gm.graph.nodes)),))  # doctest: +ELLIPSIS
        relu
        >>> _ = gm.recompile()
        >>> fingerprint(gm) == before
        False
    """
    mods = []
    for name, m in gm.named_modules(remove_duplicate=False):
        code = m.code if isinstance(m, fx.GraphModule) else None
        hooks = () if not name else (len(m._forward_hooks), len(m._forward_pre_hooks))
        wrapped = "" if not name else "forward" in m.__dict__
        mods.append((name, id(m), type(m), code, hooks, wrapped))  # a forward wrap: a class
    state = [
        (n, id(t), tuple(t.shape))
        for n, t in [
            *gm.named_parameters(remove_duplicate=False),
            *gm.named_buffers(remove_duplicate=False),
        ]
    ]
    return tuple(mods), tuple(state)


def _edits(gm: nn.Module, before: tuple[Any, ...]) -> str:
    """What differs from ``before`` (for messages); "" where nothing does."""
    mods, state = fingerprint(gm)
    old_mods, old_state = before
    if mods != old_mods:
        old = {m[0]: m for m in old_mods}
        changed = [m[0] or "<root>" for m in mods if old.get(m[0]) != m]
        gone = [n or "<root>" for n in old if n not in {m[0] for m in mods}]
        return "changed: " + ", ".join((changed + gone)[:4])
    if state != old_state:
        old = {s[0]: s for s in old_state}
        return "parameters changed: " + ", ".join(s[0] for s in state if old.get(s[0]) != s)[:200]
    return ""


def optional_reads(gm: fx.GraphModule, mod: nn.Module) -> tuple[str, ...]:
    """The arguments of ``mod.forward`` that default to None but that the fx graph ``gm`` reads
    as if given (symbolic tracing takes ``x is None`` to be False): a call passing None for one
    of them needs another graph (even one only handed to a kept submodule: the module would
    not have handed it on as None)."""
    sig = _signature(mod)
    if sig is None:
        return ()
    params = sig.parameters
    optional = {n for n, p in params.items() if p.default is None}
    found = []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.target in optional and node.users:
            found.append(str(node.target))
    return tuple(found)


class Retracer:
    """The forward of a traced module that may be traced again: runs the traced graph, and for
    a call unlike every traced one, a graph traced again from the original module (the
    :mod:`slapo.tracing.retrace` docstring). Installed as the instance's ``forward``."""

    def __init__(
        self,
        gm: fx.GraphModule,
        mod: nn.Module,
        used: str,
        trace_once: TraceOnce,
        concrete_args: dict[str, Any] | None,
        path: str,
    ) -> None:
        self.gm = gm
        self.mod = mod  # the original: the same parameter and buffer objects as the graph's
        self.used = used  # "export" or "fx"
        self.trace_once = trace_once
        self.concrete_args = dict(concrete_args or {})
        self.path = path
        self.where = f'"{label(path)}" ({type(mod).__name__})'
        self.reads = optional_reads(gm, mod) if used == "fx" else ()
        self.signature = _signature(mod) if self.reads else None
        self.before = fingerprint(gm)
        self.guard = next((g for g in vars(gm).values() if isinstance(g, SignatureGuard)), None)
        self.exported: list[tuple[fx.GraphModule, SignatureGuard | None]] = []
        self.by_absent: dict[frozenset[str], fx.GraphModule] = {}  # fx graphs: None arguments

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.reads:
            absent = self._absent(args, kwargs)
            if absent:
                return self._other(self._fx_message(absent), args, kwargs, absent)
        try:
            return type(self.gm).forward(self.gm, *args, **kwargs)
        except TraceSignatureError as exc:
            if getattr(exc, "guard", None) is not self.guard or self.guard is None:
                raise
            return self._other(str(exc), args, kwargs, frozenset())

    def __reduce__(self) -> Any:
        raise TypeError("a Retracer is not pickled (the graph module drops it)")

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None  # a copy of the graph module keeps its graph and guard only

    def rebind(self, new_of: dict[int, torch.Tensor]) -> None:
        """Follow a materialization: ``new_of`` maps ``id`` of each meta tensor to the tensor
        that replaced it (same shape). The original module and the graphs traced again hold the
        new tensors, and the fingerprint takes them as the traced ones: giving storage to a meta
        parameter is no edit (a parameter replaced otherwise still is).

        Example:
            >>> # called by slapo.initialization.materialize_module
        """
        for holder in [self.mod, *(g for g, _ in self.exported), *self.by_absent.values()]:
            for module in holder.modules():
                for store in (module._parameters, module._buffers):
                    for name, t in list(store.items()):
                        new = new_of.get(id(t)) if t is not None else None
                        if new is not None and new.shape == t.shape:
                            store[name] = new  # type: ignore[assignment]
        mods, state = self.before
        renamed = []
        for name, key, shape in state:
            new = new_of.get(key)
            renamed.append((name, id(new), shape) if new is not None else (name, key, shape))
        self.before = (mods, tuple(renamed))

    def _absent(self, args: tuple, kwargs: dict[str, Any]) -> frozenset[str]:
        try:
            bound = self.signature.bind(*args, **kwargs)  # type: ignore[union-attr]
        except TypeError:
            return frozenset()
        return frozenset(n for n in self.reads if bound.arguments.get(n) is None)

    def _fx_message(self, absent: frozenset[str]) -> str:
        names = ", ".join(f'"{n}"' for n in sorted(absent))
        return (
            f"{self.where} was traced by torch.fx with argument(s) {names} given, but is called "
            "with None for them; the graph is specialized to them being given."
        )

    def _other(self, why: str, args: tuple, kwargs: dict[str, Any], absent: frozenset[str]) -> Any:
        """Run the call on a graph traced for its signature (traced now if there is none)."""
        edits = _edits(self.gm, self.before)
        if edits:
            raise TraceSignatureError(
                f"{why} The graph was edited after tracing ({edits}), so it cannot be traced "
                "again for this call: trace the module on example inputs of the shape and "
                "arguments it is called with (create_schedule(model, example_inputs=<a batch of "
                "the training shape>) or trace(example_inputs=...)) before editing it."
            )
        if self.used == "fx" and absent in self.by_absent:
            return self._run(self.by_absent[absent], args, kwargs)
        for graph, guard in self.exported:
            if not _takes(graph, args, kwargs):  # traced on a call with other keywords
                continue
            try:
                return self._run(graph, args, kwargs)
            except TraceSignatureError as exc:
                if guard is None or getattr(exc, "guard", None) is not guard:
                    raise
        self._check_room(why)
        if self.used == "fx":  # fx again, the arguments passed as None fixed to None
            concrete = {**{n: None for n in absent}, **self.concrete_args}
            try:
                graph = self.trace_once(self.mod, "fx", None, concrete)
            except TraceError as exc:
                fx_failed = f" (fx could not: {exc})"
            else:
                self.by_absent[absent] = graph
                self._log("torch.fx")
                return self._run(graph, args, kwargs)
        else:
            fx_failed = ""
        detached = pytree.tree_map(
            lambda v: v.detach() if isinstance(v, torch.Tensor) else v, (args, kwargs)
        )
        inputs = {"args": detached[0], "kwargs": detached[1]}
        try:
            graph = self.trace_once(self.mod, "export", inputs, None)
        except TraceError as exc:
            raise TraceSignatureError(
                f"{why} Tracing it again for this call failed: {exc}{fx_failed}"
            ) from exc
        guard = next((g for g in vars(graph).values() if isinstance(g, SignatureGuard)), None)
        self.exported.append((graph, guard))
        self._log("torch.export")
        return self._run(graph, args, kwargs)

    def _check_room(self, why: str) -> None:
        count = len(self.exported) + len(self.by_absent)
        if count >= MAX_SIGNATURES:
            raise TraceSignatureError(
                f"{why} It was traced again for {count} other signatures already (at most "
                f"{MAX_SIGNATURES}); trace it on inputs of the shape it is called with."
            )
        if _tracing_now():
            raise TraceSignatureError(f"{why} (it is not traced again while being compiled)")

    def _log(self, tracer: str) -> None:
        get_logger().info(
            "traced %s again with %s for a call unlike the traced one", self.where, tracer
        )

    def _run(self, graph: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Call ``graph`` with the train/eval flags of the traced module (by name)."""
        flags = {name: m.training for name, m in self.gm.named_modules()}
        for name, m in graph.named_modules():
            m.training = flags.get(name, self.gm.training)
        return graph(*args, **kwargs)


def _signature(mod: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(mod.forward)
    except (TypeError, ValueError):
        return None


def _takes(graph: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether ``graph``'s forward accepts ``(args, kwargs)`` (positional and keyword as given)."""
    try:
        inspect.signature(graph.forward).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _tracing_now() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except AttributeError:  # pragma: no cover  (older torch)
        return False


def install_retrace(
    gm: fx.GraphModule,
    mod: nn.Module,
    used: str,
    trace_once: TraceOnce,
    concrete_args: dict[str, Any] | None,
    path: str,
) -> None:
    """Make ``gm`` trace ``mod`` again (with ``trace_once``) for calls unlike the traced one,
    while ``gm`` is not edited. Pickling ``gm`` leaves this out (a copy raises instead).

    Example:
        >>> # installed by trace_module; see the module docstring
    """
    retracer = Retracer(gm, mod, used, trace_once, concrete_args, path)
    if used == "export" and retracer.guard is None:
        return  # nothing is checked: nothing to trace again for
    if used == "fx" and not retracer.reads:
        return
    gm.__dict__[_ATTR] = retracer
    gm.__dict__["forward"] = retracer
    cls = type(gm)  # fx makes a class per GraphModule instance
    if "__reduce__" not in vars(cls):
        cls.__reduce__ = _reduce_without_retrace  # type: ignore[method-assign]


def _reduce_without_retrace(self: fx.GraphModule) -> Any:
    saved = {k: self.__dict__.pop(k) for k in (_ATTR, "forward") if k in self.__dict__}
    try:
        return fx.GraphModule.__reduce__(self)
    finally:
        self.__dict__.update(saved)
