"""The signature guard of an exported graph: torch.export fixes what it cannot keep symbolic (a
dimension a loop ran over, every non-tensor argument, which optional arguments were given), so
the graph is only valid for calls like the captured one. The guard, the first call of the graph,
checks each call against the capture and raises :class:`TraceSignatureError` (naming the module,
the argument and what differs) instead of silently computing something else; the traced module
catches that error and traces the original module again for the call, unless the graph was
edited since (``retrace``).

Example:
    >>> from torch import nn
    >>> from slapo.tracing import trace_module
    >>> class Unrolled(nn.Module):
    ...     def forward(self, x):  # a Python loop over the sequence: export unrolls it
    ...         return torch.stack([x[:, i] * i for i in range(x.shape[1])], 1)
    >>> gm = trace_module(Unrolled(), torch.randn(2, 5), tracer="export", path="block")
    >>> gm(torch.randn(3, 5)).shape  # the batch stays free
    torch.Size([3, 5])
    >>> gm(torch.randn(2, 7)).shape  # traced again for this length (see retrace.py)
    torch.Size([2, 7])
    >>> gm.register_buffer("edited", torch.ones(1))  # edited after tracing: no more re-tracing
    >>> gm(torch.randn(2, 9))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    slapo.tracing.errors.TraceSignatureError: "block" (Unrolled) was traced for size 5 in dim 1 of ...
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..surgery import label, unique_name
from .errors import TraceSignatureError

__all__ = ["SignatureGuard", "check_call", "install_guard"]

_POSITIONAL = "_positional_arg_"  # how torch.export's unflatten names positional inputs
_EXTRA = "**kwargs"
_CONSTANTS = (bool, int, float, str, type(None), torch.dtype, torch.device)


@dataclass(frozen=True)
class _Leaf:
    """What one leaf of a captured argument was: a tensor (with the dims the graph fixed) or a
    constant baked into the graph."""

    is_tensor: bool
    value: Any = None  # a constant's value (_CONSTANTS), or an _Object
    ndim: int = 0
    static: tuple[tuple[int, int], ...] = ()  # (dim, size) the graph is specialized to
    symbols: tuple[tuple[int, str, int, int | None], ...] = ()  # (dim, symbol, min, max)
    used: bool = True


@dataclass(frozen=True)
class _Arg:
    """One argument of the captured call (a placeholder of the graph)."""

    name: str  # how messages call it
    spec: pytree.TreeSpec
    leaves: tuple[_Leaf, ...]

    @property
    def free(self) -> bool:
        """It was tensors the graph never reads: any value (or none) may be passed. An argument
        that was None is not free: given, the module would have computed something else."""
        return bool(self.leaves) and all(leaf.is_tensor and not leaf.used for leaf in self.leaves)


@dataclass
class _Bindings:
    """Runtime sizes of the symbolic dims, to check that dims the graph equates stay equal."""

    sizes: dict[str, tuple[int, str]] = field(default_factory=dict)


class SignatureGuard:
    """Checks a call of a traced graph against the call it was traced on.

    Not a module: the graph reads it as an attribute (no state_dict keys, no schedule child)
    and calls :func:`check_call` with it, a call dead-code elimination keeps.
    """

    def __init__(self, where: str, args: list[_Arg], hint: str, attr: str) -> None:
        self.where = where
        self.args = args
        self.hint = hint
        self.attr = attr  # its attribute name on the graph module

    def __repr__(self) -> str:
        return f"SignatureGuard({self.where}, {len(self.args)} arguments)"

    def check(self, *values: Any) -> None:
        """Raise :class:`TraceSignatureError` unless ``values`` (the graph's inputs, then the
        dict of extra keyword arguments) are like the traced call's."""
        if any(isinstance(v, fx.Proxy) for v in pytree.tree_leaves(values)):
            self._record(values)  # the graph is being traced again (unpickling, flattening)
            return
        *given, extra = values
        bindings = _Bindings()
        for arg, value in zip(self.args, given, strict=True):
            self._check_arg(arg, value, bindings)
        for name, value in (extra or {}).items():
            if value is not None and not _is_cache(value):
                self._fail(f'argument "{name}" = None (not given)', f"{_describe(value)} for it")

    def _record(self, values: tuple[Any, ...]) -> None:
        """Record this check in the graph being traced, as the call it is in this graph."""
        proxy = next(v for v in pytree.tree_leaves(values) if isinstance(v, fx.Proxy))
        tracer = proxy.tracer
        root = getattr(tracer, "root", None)
        owners = root.named_modules() if isinstance(root, nn.Module) else ()
        prefix = next((n for n, m in owners if m.__dict__.get(self.attr) is self), None)
        if prefix is None:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a get_attr of a non-tensor attribute
            guard = tracer.create_proxy("get_attr", f"{prefix}.{self.attr}".lstrip("."), (), {})
        tracer.create_proxy("call_function", check_call, (guard, *values), {})

    def _fail(self, traced: str, now: str) -> None:
        exc = TraceSignatureError(
            f"{self.where} was traced for {traced}, but is called with {now}; the graph is "
            f"specialized to the traced call. {self.hint}"
        )
        exc.guard = self  # type: ignore[attr-defined]  (which graph refused: see retrace.py)
        raise exc

    def _check_arg(self, arg: _Arg, value: Any, bindings: _Bindings) -> None:
        if arg.free and _is_absent(value):
            return
        flat, spec = pytree.tree_flatten(_no_caches(value))
        if spec != arg.spec:
            if arg.free:
                return
            traced = _describe(pytree.tree_unflatten([_Shown(x) for x in arg.leaves], arg.spec))
            self._fail(f"{arg.name} = {traced}", f"{_describe(value)}")
        for i, (leaf, x) in enumerate(zip(arg.leaves, flat, strict=True)):
            where = arg.name if len(flat) == 1 else f"{arg.name} (leaf {i})"
            self._check_leaf(leaf, x, where, bindings)

    def _check_leaf(self, leaf: _Leaf, x: Any, where: str, bindings: _Bindings) -> None:
        if not leaf.is_tensor:
            if not _same_constant(leaf.value, x):
                self._fail(f"{where} = {leaf.value!r}", f"{where} = {_describe(x)}")
            return
        if not isinstance(x, torch.Tensor):
            self._fail(f"a tensor as {where}", f"{_describe(x)}")
        if not leaf.used:
            return
        if x.dim() != leaf.ndim:
            self._fail(f"a {leaf.ndim}-d tensor as {where}", f"a {x.dim()}-d one")
        for dim, size in leaf.static:
            if x.shape[dim] != size:
                self._fail(f"size {size} in dim {dim} of {where}", f"size {x.shape[dim]}")
        for dim, symbol, low, high in leaf.symbols:
            self._check_symbol(x.shape[dim], f"dim {dim} of {where}", symbol, low, high, bindings)

    def _check_symbol(
        self, size: int, where: str, symbol: str, low: int, high: int | None, bindings: _Bindings
    ) -> None:
        if size < low or (high is not None and size > high):
            bound = f"[{low}, {high}]" if high is not None else f">= {low}"
            self._fail(f"sizes {bound} in {where}", f"size {size}")
        seen = bindings.sizes.setdefault(symbol, (size, where))
        if seen[0] != size:
            self._fail(f"equal sizes in {seen[1]} and {where}", f"sizes {seen[0]} and {size}")


@fx.node.has_side_effect
def check_call(guard: SignatureGuard, *values: Any) -> None:
    """The graph's first call: ``guard.check(*values)`` (a side effect: never eliminated)."""
    guard.check(*values)


class _Shown:
    """A captured leaf as messages show it."""

    def __init__(self, leaf: _Leaf) -> None:
        self.leaf = leaf

    def __repr__(self) -> str:
        if not self.leaf.is_tensor:
            return repr(self.leaf.value)
        return f"a {self.leaf.ndim}-d tensor" if self.leaf.used else "an unused tensor"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, _Shown):
        return repr(value)
    if isinstance(value, tuple | list) and value:
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    if isinstance(value, dict) and value:
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, _CONSTANTS):
        return repr(value)
    return f"a {type(value).__name__}"


def _is_cache(value: Any) -> bool:
    return type(value).__name__.endswith("Cache") and not isinstance(value, torch.Tensor)


def _no_caches(value: Any) -> Any:
    """KV caches are None in the graph (and replaced by None at run time)."""
    return None if _is_cache(value) else value


def _is_absent(value: Any) -> bool:
    return value is None or _is_cache(value)


@dataclass(frozen=True)
class _Object:
    """A non-constant, non-tensor argument (a config, a callable): only its type is checked."""

    type_name: str

    def __repr__(self) -> str:
        return f"a {self.type_name}"


def _same_constant(traced: Any, now: Any) -> bool:
    if isinstance(traced, _Object):
        return type(now).__name__ == traced.type_name
    numbers = (int, float, torch.SymInt, torch.SymFloat)  # symbolic under torch.compile
    kinds = {bool: (bool, torch.SymBool), int: numbers, float: numbers}
    if not isinstance(now, kinds.get(type(traced), type(traced))):
        return False
    if isinstance(now, bool) and type(traced) is not bool:  # True is no 1
        return False
    try:
        return bool(traced == now)
    except Exception:  # noqa: BLE001  (an object without a usable ==)
        return False


def _leaf_of(value: Any, meta: Any, used: bool, ranges: dict[Any, Any]) -> _Leaf:
    """The expectation for one captured leaf; ``meta`` is export's fake tensor of it."""
    if not isinstance(value, torch.Tensor):
        kept = value if isinstance(value, _CONSTANTS) else _Object(type(value).__name__)
        return _Leaf(False, kept)
    static: list[tuple[int, int]] = []
    symbols: list[tuple[int, str, int, int | None]] = []
    for dim, size in enumerate(meta.shape if meta is not None else value.shape):
        expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)
        if not expr.free_symbols:  # export fixed this dim (e.g. a loop ran over it)
            static.append((dim, int(expr)))
        elif isinstance(expr, sympy.Symbol):
            symbols.append((dim, str(expr), *_range(ranges.get(expr))))
        # a derived size (s0 * 2) follows from its symbols' checks
    return _Leaf(True, None, value.dim(), tuple(static), tuple(symbols), used)


def _range(vr: Any) -> tuple[int, int | None]:
    if vr is None:
        return 0, None
    low, high = _as_int(vr.lower), _as_int(vr.upper)
    return low if low is not None else 0, high


def _as_int(bound: Any) -> int | None:
    """A finite bound as an int; None for infinity (export's ``int_oo``)."""
    try:
        return int(bound)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


def _arg_names(mod: nn.Module, n_args: int) -> list[str]:
    """Names of the positional parameters of ``mod.forward``, for messages."""
    try:
        params = list(inspect.signature(mod.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [
        f'argument {i} ("{names[i]}")' if i < len(names) else f"argument {i}" for i in range(n_args)
    ]


def install_guard(
    gm: fx.GraphModule,
    mod: nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
    ep: torch.export.ExportedProgram,
    path: str,
) -> str:
    """Make the first call of ``gm``'s graph a :class:`SignatureGuard` of the call
    ``(args, kwargs)`` that ``ep`` was exported on (caches already None). Keyword arguments get
    a default of None and extra ones are collected, so the guard names them. Returns the guard's
    attribute name, or "" (installing nothing) where the graph's inputs are not the captured
    call's.

    Example:
        >>> # installed by export_module; see the module docstring
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [f"{_POSITIONAL}{i}" for i in range(len(args))] + list(kwargs)
    if [str(n.target) for n in placeholders] != names or "kwargs" in kwargs:
        return ""
    metas = _user_input_metas(ep)
    ranges = dict(ep.range_constraints)
    arg_labels = _arg_names(mod, len(args))
    expected: list[_Arg] = []
    tensors = iter(metas)
    for value, shown in [
        *zip(args, arg_labels, strict=True),
        *((v, f'argument "{k}"') for k, v in kwargs.items()),
    ]:
        flat, spec = pytree.tree_flatten(value)
        leaves = []
        for x in flat:
            meta, used = (
                next(tensors, (None, True)) if isinstance(x, torch.Tensor) else (None, True)
            )
            leaves.append(_leaf_of(x, meta, used, ranges))
        expected.append(_Arg(shown, spec, tuple(leaves)))
    where = f'"{label(path)}" ({type(mod).__name__})'
    hint = (
        "Trace it on inputs like this call's: create_schedule(model, example_inputs=<a batch "
        "of the training shape>) or trace(example_inputs=...)."
    )
    guard_name = unique_name(gm, "_slapo_guard")
    setattr(gm, guard_name, SignatureGuard(where, expected, hint, guard_name))
    for ph in placeholders[len(args) :]:
        ph.args = (None,)  # an omitted keyword is None, as the guard expects
    with gm.graph.inserting_after(placeholders[-1] if placeholders else None):
        extra = gm.graph.placeholder(_EXTRA)
    with gm.graph.inserting_after(extra), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fx warns of a get_attr of a non-tensor attribute
        guard = gm.graph.get_attr(guard_name)
    with gm.graph.inserting_after(guard):
        gm.graph.call_function(check_call, (guard, *placeholders, extra))
    gm.graph.lint()
    gm.recompile()
    return guard_name


def _user_input_metas(ep: torch.export.ExportedProgram) -> list[tuple[Any, bool]]:
    """``(fake tensor, used)`` of each user input of ``ep``, in order."""
    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    out = []
    for name in ep.graph_signature.user_inputs:
        node = nodes.get(name)
        meta = node.meta.get("val") if node is not None else None
        out.append((meta, node is None or bool(node.users)))
    return out
