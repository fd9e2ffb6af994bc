"""A Hugging Face-aware tracer on ``torch.fx``: traces a transformers-5 block with no inputs.

Plain symbolic tracing fails on most transformers-5 modules: their ``forward`` takes
``**kwargs`` (``co_varnames is too small``), unpacks shapes (``Proxy object cannot be iterated``)
and branches on sizes. :class:`HFTracer` traces them as follows.

* **Signature.** ``forward`` is bound to a concrete call: a required argument becomes an input
  (a tensor of the module's hidden size, ``position_embeddings`` a ``(cos, sin)`` pair); an
  optional one is fixed to its default (``attention_mask=None``, ``use_cache=False``,
  ``cache=None``) unless ``concrete_args`` names it (a tensor there is an input traced with
  that shape, any other value fixes it); ``**kwargs`` is empty unless ``concrete_args`` names
  entries of it.
* **Values.** Every proxy carries a value computed on the ``meta`` device (no memory, no
  data), as transformers' own fx tracer did. Sizes stay graph nodes where ops consume them
  (``view(*x.shape[:-1], -1)`` is traced for any batch and length). Where Python needs a plain
  value (``if q.shape[2] > 1``, ``a, b = out``, ``range(n)``, ``len(x)``) the meta value is
  used, and the graph gets a check of that value at run time.
* **Leaves.** The attention-interface functions (``eager_attention_forward``, what
  ``ALL_ATTENTION_FUNCTIONS`` holds) and the mask utilities stay ``call_function`` nodes of
  the original function (whose module argument is the original attention module); the
  user's leaves stay ``call_module`` nodes.
* **Specialisation.** The graph is valid for calls like the traced one: the same non-tensor
  arguments, the same tensor arguments given (ranks as traced) and the same outcome of each
  size-dependent branch. A :class:`~slapo.tracing.guard.SignatureGuard` checks the first two at
  the graph's start and the branch checks run where the branch was; a call unlike the traced
  one raises :class:`~slapo.tracing.errors.TraceSignatureError`, and the traced module traces
  itself again on that call's inputs (see :mod:`slapo.tracing.retrace`) while unedited.

Example:
    >>> import transformers
    >>> config = transformers.BertConfig(hidden_size=32, num_attention_heads=4,
    ...                                  intermediate_size=64, num_hidden_layers=1)
    >>> layer = transformers.BertModel(config).encoder.layer[0]
    >>> gm = hf_trace(layer, leaves=(), config=config)
    >>> "attention.self.query" in [n.target for n in gm.graph.nodes if n.op == "call_module"]
    True
    >>> x = torch.randn(3, 5, 32)  # other sizes than the synthesized 2 x 8
    >>> torch.testing.assert_close(gm.eval()(x), layer.eval()(x))
"""

from __future__ import annotations

import functools
import inspect
import operator
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from types import FunctionType
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..surgery import label, unique_name
from .errors import TraceError
from .guard import _EXTRA, SignatureGuard, _Arg, _Leaf, _leaf_of, check_call
from .rewrite import TrainingOnly

__all__ = ["HFTracer", "check_value", "hf_trace"]

BATCH, SEQ = 2, 8  # the synthesized inputs' batch and length (sizes stay symbolic in the graph)
_UNKNOWN = object()  # a value the meta run could not compute
_META = "slapo_meta"  # node.meta key of the meta value

# Functions of transformers kept as calls: attention kernels and mask builders.
_LEAF_NAMES = (
    "eager_attention_forward",
    "sdpa_attention_forward",
    "flash_attention_forward",
    "flex_attention_forward",
    "paged_attention_forward",
    "create_causal_mask",
    "create_bidirectional_mask",
    "create_sliding_window_causal_mask",
    "create_chunked_causal_mask",
    "create_masks_for_generate",
    "_prepare_4d_attention_mask",
    "_prepare_4d_causal_attention_mask",
)


def _is_meta_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _to_meta(x: Any) -> Any:
    """A meta copy of a tensor (the same shape, dtype and strides), other values as they are."""
    if isinstance(x, torch.Tensor) and not _is_meta_tensor(x):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


@fx.node.has_side_effect
def check_value(guard: SignatureGuard, value: Any, expected: Any, what: str) -> None:
    """A check the graph runs where the trace read a value Python needed plainly (a branch on a
    size, a length): ``value`` (``bool``/``int``/``len`` applied already) must be ``expected``.

    Example:
        >>> check_value(None, 3, 3, "the length")  # no guard needed when the value matches
    """
    if isinstance(value, fx.Proxy):  # the graph traced again (flattening): keep the check
        value.tracer.create_proxy("call_function", check_value, (guard, value, expected, what), {})
        return
    if value != expected:
        guard._fail(f"{what} = {expected!r}", f"{what} = {value!r}")


def _same(value: Any) -> Any:
    return value


_PLAIN = {"bool": bool, "int": operator.index, "float": float, "len": len, "value": _same}


def _where() -> str:
    """The model line being traced (the innermost frame outside torch and slapo)."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and "/slapo/" not in frame.filename:
            return (
                f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} `{(frame.line or '').strip()}`"
            )
    return "the traced code"


class _MetaProxy(fx.Proxy):
    """A proxy whose meta value answers what Python asks plainly, recorded as a run-time check."""

    def _concrete(self, kind: str) -> Any:
        return self.tracer.concrete(self, kind)  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return self._concrete("len")

    def __iter__(self) -> Iterator[fx.Proxy]:
        return iter([self[i] for i in range(self._concrete("len"))])

    def __int__(self) -> int:
        return self._concrete("int")

    def __index__(self) -> int:
        return self._concrete("int")

    def __float__(self) -> float:
        return self._concrete("float")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_node":
            raise AttributeError(name)
        attr = _MetaAttribute(self, name)
        if name in _PLAIN_ATTRIBUTES:  # torch.finfo(x.dtype) needs a dtype: checked at run time
            return self.tracer.concrete(attr, "value")  # type: ignore[attr-defined]
        return attr


_PLAIN_ATTRIBUTES = ("dtype",)


class _MetaAttribute(fx.proxy.Attribute, _MetaProxy):
    """``proxy.attr`` (``x.shape``, ``x.dtype``): a node once used, with a meta value."""


class HFTracer(fx.Tracer):
    """``torch.fx`` tracer for transformers modules (see the module docstring).

    Args:
        root: the module to trace.
        is_leaf: ``(module, qualified name) -> bool`` for modules kept as ``call_module``.
        inputs: ``{argument name: meta value}`` for the arguments traced as inputs.
        fixed: ``{argument name: value}`` for the arguments fixed to a value.

    Example:
        >>> # built by hf_trace; see the module docstring
    """

    def __init__(
        self,
        root: nn.Module,
        is_leaf: Callable[[nn.Module, str], bool],
        inputs: dict[str, Any],
        fixed: dict[str, Any],
    ) -> None:
        super().__init__()
        self.proxy_buffer_attributes = True  # a buffer sliced by sizes stays a graph node
        self._root = root
        self._is_leaf = is_leaf
        self._inputs = inputs
        self._fixed = fixed
        self._paths = {id(m): n for n, m in root.named_modules()}
        self.checks: list[fx.Node] = []  # check_value nodes: their guard is set afterwards

    # -- leaves -----------------------------------------------------------------------------
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return self._is_leaf(m, qualname) or super().is_leaf_module(m, qualname)

    def leaf_call(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` as one ``call_function`` node; a module argument is read
        from the graph's module (the original attention module). The traced module itself
        cannot be an argument of its own graph: then ``fn`` is traced into instead."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        mapped = []
        for value in flat:
            if isinstance(value, nn.Module):
                path = self._paths.get(id(value))
                if not path:  # the root, or a module outside it
                    return fn(*args, **kwargs)
                value = self.create_proxy("get_attr", path, (), {})
            mapped.append(value)
        args, kwargs = pytree.tree_unflatten(mapped, spec)
        return self.create_proxy("call_function", fn, args, kwargs)

    # -- signature --------------------------------------------------------------------------
    def create_args_for_root(
        self, root_fn: Callable[..., Any], is_module: bool, concrete_args: Any = None
    ) -> tuple[Callable[..., Any], list[Any]]:
        """Placeholders for the bound signature; fixed arguments are placeholders too (with
        their default) so the graph takes the module's arguments, and the guard reads them."""
        sig = inspect.signature(inspect.unwrap(root_fn))
        params = list(sig.parameters.values())[1:]  # without self
        placeholders: list[fx.Proxy] = []
        positional: list[Any] = []
        keywords: dict[str, Any] = {}
        ordered = sorted(params, key=lambda p: p.kind == p.VAR_KEYWORD)
        for p in ordered:
            if p.kind == p.VAR_POSITIONAL:
                placeholders.append(self.create_proxy("placeholder", f"*{p.name}", (), {}))
                continue
            if p.kind == p.VAR_KEYWORD:
                placeholders.append(self.create_proxy("placeholder", f"**{p.name}", (), {}))
                keywords.update(self._fixed.get(_EXTRA, {}))
                continue
            default = () if p.default is p.empty else (_default_repr(p.default),)
            proxy = self.create_proxy("placeholder", p.name, default, {})
            placeholders.append(proxy)
            value = proxy if p.name in self._inputs else self._fixed[p.name]
            if p.kind == p.KEYWORD_ONLY:
                keywords[p.name] = value
            else:
                positional.append(value)

        def run(*_: Any) -> Any:
            return root_fn(self._root, *positional, **keywords)

        return run, placeholders

    # -- values -----------------------------------------------------------------------------
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _MetaProxy(node, self)

    def create_proxy(
        self,
        kind: str,
        target: Any,
        args: tuple,
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any = None,
        proxy_factory_fn: Any = None,
    ) -> fx.Proxy:
        if name is None and target == "self":  # a child named "self" (BERT's): not the module
            name = "self_module"
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        # fx's patches off: the meta run must not record module calls or attribute reads.
        with fx._symbolic_trace._maybe_revert_all_patches():
            proxy.node.meta[_META] = self._meta_value(kind, target, args, kwargs)
        return proxy

    def _meta_value(self, kind: str, target: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        if kind == "placeholder":
            return self._inputs.get(str(target).lstrip("*"), _UNKNOWN)
        if kind == "get_attr":
            value = _get(self._root, str(target))
            return _to_meta(value) if value is not _UNKNOWN else _UNKNOWN
        if kind == "output":
            return _UNKNOWN
        try:
            margs, mkwargs = _metas((args, kwargs))
        except LookupError:
            return _UNKNOWN
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if kind == "call_function":
                    return target(*margs, **mkwargs)
                if kind == "call_method":
                    return getattr(margs[0], target)(*margs[1:], **mkwargs)
                if kind == "call_module":
                    mod = self._root.get_submodule(target)
                    state = {
                        n: _to_meta(t) for n, t in [*mod.named_parameters(), *mod.named_buffers()]
                    }
                    return torch.func.functional_call(mod, state, tuple(margs), mkwargs)
        except Exception:  # noqa: BLE001  (an op without a meta kernel: the value stays unknown)
            return _UNKNOWN
        return _UNKNOWN

    def concrete(self, proxy: fx.Proxy, kind: str) -> Any:
        """The plain value ``kind`` of ``proxy`` from its meta value, checked at run time."""
        value = proxy.node.meta.get(_META, _UNKNOWN)
        where = _where()
        if value is _UNKNOWN or (_is_meta_tensor(value) and kind != "len"):
            raise TraceError(
                f"{kind}() of a traced value at {where}: it depends on tensor data (or on an op "
                "the meta device cannot run), which a graph traced without inputs cannot know"
            )
        plain = _PLAIN[kind](value)
        what = f"{kind}(...) at {where}" if kind != "value" else f"the value at {where}"
        converted = (
            proxy
            if kind == "value"
            else self.create_proxy("call_function", _PLAIN[kind], (proxy,), {})
        )
        check = self.create_proxy("call_function", check_value, (None, converted, plain, what), {})
        self.checks.append(check.node)
        return plain

    def to_bool(self, obj: fx.Proxy) -> bool:
        return self.concrete(obj, "bool")

    def iter(self, obj: fx.Proxy) -> Iterator[fx.Proxy]:
        return iter(_MetaProxy.__iter__(obj))  # type: ignore[arg-type]

    def keys(self, obj: fx.Proxy) -> Any:
        value = obj.node.meta.get(_META, _UNKNOWN)
        if not isinstance(value, dict):
            return super().keys(obj)
        self.concrete(obj, "len")
        return list(value)


def _default_repr(value: Any) -> Any:
    """A placeholder default the generated code can spell (else None: the guard compares)."""
    simple = (bool, int, float, str, type(None))
    return value if isinstance(value, simple) else None


def _get(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, _UNKNOWN)
        if obj is _UNKNOWN:
            return _UNKNOWN
    return obj


def _metas(tree: Any) -> Any:
    """``tree`` with each proxy replaced by its meta value (LookupError where unknown)."""

    def one(x: Any) -> Any:
        if isinstance(x, fx.Proxy):
            value = x.node.meta.get(_META, _UNKNOWN)
            if value is _UNKNOWN:
                raise LookupError
            return value
        if isinstance(x, slice):
            return slice(one(x.start), one(x.stop), one(x.step))
        return x

    return pytree.tree_map(one, tree)


# -- leaf functions --------------------------------------------------------------------------
def _leaf_functions() -> dict[int, Callable[..., Any]]:
    """The transformers functions kept as calls, by id."""
    found: dict[int, Callable[..., Any]] = {}
    mapping = _attention_mapping()
    if mapping is not None:
        for fn in [*mapping._global_mapping.values(), *mapping._local_mapping.values()]:
            found[id(fn)] = fn
    for name in ("transformers.masking_utils", "transformers.modeling_attn_mask_utils"):
        module = sys.modules.get(name)
        for attr in _LEAF_NAMES:
            fn = getattr(module, attr, None) if module is not None else None
            if isinstance(fn, FunctionType):
                found[id(fn)] = fn
    return found


def _attention_mapping() -> Any:
    module = sys.modules.get("transformers.modeling_utils")
    return getattr(module, "ALL_ATTENTION_FUNCTIONS", None)


class _LeafPatch:
    """Replace the leaf functions, where the traced code looks them up (its modules' globals,
    ``ALL_ATTENTION_FUNCTIONS``), by wrappers that record one node when given proxies."""

    def __init__(self, tracer: HFTracer, root: nn.Module) -> None:
        self.tracer = tracer
        self.modules = {sys.modules.get(type(m).__module__) for m in root.modules()}
        self.undo: list[tuple[dict[str, Any], str, Any]] = []

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        tracer = self.tracer

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not any(isinstance(x, fx.Proxy) for x in pytree.tree_leaves((args, kwargs))):
                return fn(*args, **kwargs)
            return tracer.leaf_call(fn, args, kwargs)

        return call

    def __enter__(self) -> _LeafPatch:
        known = _leaf_functions()
        tables: list[dict[str, Any]] = []
        mapping = _attention_mapping()
        if mapping is not None:
            tables += [mapping._global_mapping, mapping._local_mapping]
        for module in self.modules:
            if module is not None:
                tables.append(module.__dict__)
        for table in tables:
            for name, value in list(table.items()):
                leaf = id(value) in known or (
                    name == "eager_attention_forward" and isinstance(value, FunctionType)
                )
                if leaf:
                    self.undo.append((table, name, value))
                    table[name] = self.wrap(value)
        return self

    def __exit__(self, *exc: object) -> None:
        for table, name, value in reversed(self.undo):
            table[name] = value


# -- binding the signature ---------------------------------------------------------------------
def _configs(mod: nn.Module, config: Any) -> list[Any]:
    """Where sizes are read: the given config, else the module's or its first submodule's
    (a decoder layer keeps none, its attention does)."""
    found = [config] if config is not None else []
    found += [m.config for m in mod.modules() if getattr(m, "config", None) is not None][:1]
    return found


def _hidden_size(mod: nn.Module, config: Any) -> int:
    for owner in _configs(mod, config):
        for attr in ("hidden_size", "n_embd", "d_model", "embed_dim", "dim"):
            size = getattr(owner, attr, None)
            if isinstance(size, int) and size > 0:
                return size
    for sub in mod.modules():  # the first layer that takes features
        if isinstance(sub, nn.Linear):
            return sub.in_features
        if isinstance(sub, nn.LayerNorm) and len(sub.normalized_shape) == 1:
            return sub.normalized_shape[0]
    raise TraceError(
        f"{type(mod).__name__}: cannot tell the hidden size for the traced inputs; pass "
        "config=... or concrete_args with example tensors"
    )


def _head_dim(mod: nn.Module, config: Any, hidden: int) -> int:
    for owner in _configs(mod, config):
        head = getattr(owner, "head_dim", None)
        if isinstance(head, int) and head > 0:
            return head
        heads = getattr(owner, "num_attention_heads", None)
        if isinstance(heads, int) and heads > 0:
            return hidden // heads
    return hidden


def _dtype(mod: nn.Module) -> torch.dtype:
    floats = [p.dtype for p in mod.parameters() if p.is_floating_point()]
    return floats[0] if floats else torch.get_default_dtype()


def bind_call(
    mod: nn.Module,
    concrete_args: dict[str, Any] | None,
    config: Any = None,
    example: tuple[tuple, dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Bind ``mod.forward`` to a concrete call: ``(inputs, fixed)``, the meta values of the
    arguments traced as inputs and the values of the fixed ones (``fixed["**kwargs"]``: the
    ``**kwargs`` entries). ``example`` (meta ``(args, kwargs)``, as a parent's trace saw the
    call) binds first, then ``concrete_args``, then the rules of the module docstring.

    Example:
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = nn.Linear(4, 4)  # no config: the hidden size is its input's
        ...     def forward(self, x, mask=None, use_cache=False, **kwargs):
        ...         return self.fc(x)
        >>> inputs, fixed = bind_call(Block(), {"output_attentions": False}, None)
        >>> inputs["x"].shape, inputs["x"].device.type
        (torch.Size([2, 8, 4]), 'meta')
        >>> fixed
        {'**kwargs': {'output_attentions': False}, 'mask': None, 'use_cache': False}
    """
    concrete = dict(concrete_args or {})
    sig = inspect.signature(mod.forward)
    params = sig.parameters
    given: dict[str, Any] = {}
    if example is not None:
        try:
            given = dict(sig.bind_partial(*example[0], **example[1]).arguments)
        except TypeError as exc:
            raise TraceError(f"{type(mod).__name__}: the call does not bind: {exc}") from exc
    varkw = next((p.name for p in params.values() if p.kind == p.VAR_KEYWORD), None)
    extra = dict(given.pop(varkw, {}) or {}) if varkw else {}
    for name in list(concrete):
        if name not in params:
            extra[name] = concrete.pop(name)
    if extra and varkw is None:
        raise TraceError(f"{type(mod).__name__}.forward takes no argument(s) {sorted(extra)}")
    inputs: dict[str, Any] = {}
    fixed: dict[str, Any] = {_EXTRA: {}}
    dtype = _dtype(mod)
    hidden: int | None = None
    for name, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in given:
            value = given[name]
        elif name in concrete:
            value = concrete[name]
        elif p.default is not p.empty and name != "position_embeddings":
            fixed[name] = p.default
            continue
        else:  # required (or rotary embeddings): synthesized
            hidden = hidden if hidden is not None else _hidden_size(mod, config)
            shape = (BATCH, SEQ, hidden)
            if name == "position_embeddings":
                shape = (BATCH, SEQ, _head_dim(mod, config, hidden))
                value = (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
            else:
                value = torch.empty(shape, dtype=dtype)
        if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value)):
            inputs[name] = pytree.tree_map(_to_meta, value)
        else:
            fixed[name] = value
    if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(extra)):
        raise TraceError(f"{type(mod).__name__}: tensors in **kwargs are not traced as inputs")
    fixed[_EXTRA] = extra
    return inputs, fixed


# -- the trace ---------------------------------------------------------------------------------
def hf_trace(
    mod: nn.Module,
    is_leaf: Callable[[nn.Module, str], bool] | None = None,
    concrete_args: dict[str, Any] | None = None,
    config: Any = None,
    example: tuple[tuple, dict[str, Any]] | None = None,
    path: str = "",
    leaves: Any = (),
) -> fx.GraphModule:
    """Trace ``mod`` with :class:`HFTracer` into one guarded ``GraphModule`` (leaves kept).

    ``example``: the meta ``(args, kwargs)`` of the call to trace for (else synthesized, see
    :func:`bind_call`). Raises the tracing error as it is (the caller names the module).

    Example:
        >>> gm = hf_trace(nn.Sequential(nn.Linear(4, 4)))
        >>> gm(torch.randn(3, 5, 4)).shape  # traced on a 3-d meta input: valid for 3-d ones
        torch.Size([3, 5, 4])
    """
    del leaves  # the caller's is_leaf applies them
    inputs, fixed = bind_call(mod, concrete_args, config, example)
    tracer = HFTracer(mod, is_leaf or (lambda m, q: False), inputs, fixed)
    with _LeafPatch(tracer, mod):
        graph = tracer.trace(mod)
    gm = fx.GraphModule(mod, graph, class_name=type(mod).__name__)
    _install(gm, mod, tracer, inputs, fixed, path)
    _attention_dropout_follows_mode(gm)
    return gm


def _install(
    gm: fx.GraphModule,
    mod: nn.Module,
    tracer: HFTracer,
    inputs: dict[str, Any],
    fixed: dict[str, Any],
    path: str,
) -> None:
    """Put the signature guard first in the graph and point the value checks at it."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    named = [n for n in placeholders if not str(n.target).startswith("**")]
    extra = next((n for n in placeholders if str(n.target).startswith("**")), None)
    args: list[_Arg] = []
    for node in named:
        name = str(node.target).lstrip("*")
        shown = f'argument "{name}"'
        if str(node.target).startswith("*"):
            value: Any = ()
        elif name in inputs:
            value = inputs[name]
        else:
            value = fixed[name]
        flat, spec = pytree.tree_flatten(value)
        used = len(node.users) > 0
        leaves = tuple(
            _Leaf(True, None, x.dim(), (), (), used)
            if isinstance(x, torch.Tensor)
            else _leaf_of(x, None, True, {})
            for x in flat
        )
        args.append(_Arg(shown, spec, leaves))
    if extra is not None:
        flat, spec = pytree.tree_flatten(given_kwargs(fixed[_EXTRA]))
        leaves = tuple(_leaf_of(x, None, True, {}) for x in flat)
        args.append(_Arg(f'the keyword arguments "{str(extra.target)}"', spec, leaves))
    where = f'"{label(path)}" ({type(mod).__name__})'
    hint = (
        "It was traced by torch.fx without inputs; trace it on inputs like this call's "
        "(trace(example_inputs=...)) for a graph of them."
    )
    attr = unique_name(gm, "_slapo_guard")
    guard = SignatureGuard(where, args, hint, attr)
    setattr(gm, attr, guard)
    anchor = placeholders[-1] if placeholders else None
    with graph.inserting_after(anchor), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a get_attr of a non-tensor attribute
        guard_node = graph.get_attr(attr)
    checked: list[Any] = list(named)
    last = guard_node
    if extra is not None:  # compared like an argument: the fixed entries, None dropped
        with graph.inserting_after(guard_node):
            last = graph.call_function(given_kwargs, (extra,))
        checked.append(last)
    with graph.inserting_after(last):
        graph.call_function(check_call, (guard_node, *checked, None))
    for node in tracer.checks:
        node.update_arg(0, guard_node)
    graph.lint()
    gm.recompile()


def given_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``**kwargs`` of a call as the guard compares them: sorted, those given as None left
    out (transformers reads every such keyword as optional).

    Example:
        >>> given_kwargs({"b": None, "a": False})
        {'a': False}
    """
    return {k: kwargs[k] for k in sorted(kwargs) if kwargs[k] is not None}


_ATTENTION_DROPOUT = ("dropout", "dropout_p")


def _attention_dropout_follows_mode(gm: fx.GraphModule) -> None:
    """Tracing runs in training mode, so a leaf attention call got the training dropout rate;
    read it from a :class:`TrainingOnly` module instead, so ``eval()`` turns it off."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not node.target.__name__.endswith("attention_forward"):
            continue
        for key in _ATTENTION_DROPOUT:
            p = node.kwargs.get(key)
            if isinstance(p, float) and p != 0.0:
                name = unique_name(gm, "_slapo_attn_dropout_p", numbered=True)
                gm.add_submodule(name, TrainingOnly(p))
                with gm.graph.inserting_before(node):
                    flag = gm.graph.call_module(name, ())
                node.update_kwarg(key, flag)
                changed = True
    if changed:
        gm.recompile()


def call_example(gm: fx.GraphModule, target: str) -> tuple[tuple, dict[str, Any]] | None:
    """The meta ``(args, kwargs)`` of the first ``call_module`` of ``target`` in a graph traced
    by :class:`HFTracer`; None where it is not called or a value is unknown.

    Example:
        >>> gm = hf_trace(nn.Sequential(nn.Linear(4, 4)))
        >>> call_example(gm, "0")[0][0].shape
        torch.Size([2, 8, 4])
    """
    node = next((n for n in gm.graph.nodes if n.op == "call_module" and n.target == target), None)
    if node is None:
        return None

    def one(x: Any) -> Any:
        if isinstance(x, fx.Node):
            value = x.meta.get(_META, _UNKNOWN)
            if value is _UNKNOWN:
                raise LookupError
            return value
        return x

    try:
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), one)
    except LookupError:
        return None
    return tuple(args), dict(kwargs)
