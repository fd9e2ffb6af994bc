"""Microbatch split / merge of arbitrary argument pytrees, and the transfer events between them.

RoundPipe flattens ``(args, kwargs)`` with :mod:`torch.utils._pytree`, splits every batched
tensor along its batch dimension (views, so autograd reaches the caller's tensors), and
replicates everything else. Outputs are merged back per leaf position.

Split and merge specs speak :mod:`torch.distributed.pipelining`'s vocabulary: a spec is a pytree
that mirrors the data (or a prefix of it: one spec leaf covers a whole subtree) whose leaves are
``TensorChunkSpec(dim)`` (chunk / concatenate along ``dim``), ``_Replicate`` (or ``None``: the
same value for every microbatch) and, for merging only, reducers (``sum_reducer``,
:data:`avg_reducer`). Split specs also take a plain ``int`` for ``TensorChunkSpec(int)``.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.pipelining.microbatch import (
    TensorChunkSpec,
    _CustomReducer,
    _Replicate,
    sum_reducer,
)

from ..devices.threads import RunState, wait_event
from ..devices.virtual_backend import CpuEvent
from ..errors import RoundPipeError, RoundPipeTypeError, RoundPipeValueError
from .split_spec import _is_spec_leaf, check_spec, is_spec

if TYPE_CHECKING:
    from .run_config import FullRoundPipeRunConfig

__all__ = [
    "AvgReducer",
    "Batch",
    "MicrobatchMergeError",
    "MicrobatchSplitError",
    "RoundPipePackedData",
    "TensorChunkSpec",
    "avg_reducer",
    "check_spec",
    "guess_split_spec",
    "is_spec",
    "merge_microbatches",
    "pack_microbatches",
    "split_by_spec",
    "sum_reducer",
    "wait_transfer_event",
]

REPLICATE = _Replicate()


class MicrobatchSplitError(RoundPipeError, TypeError, AssertionError):
    """A custom ``split_input`` / ``split_label`` callable returned a malformed structure.

    A ``TypeError``; also an ``AssertionError``, the error seed 004 names for this case.
    """


class MicrobatchMergeError(RoundPipeError, ValueError):
    """Per-microbatch outputs that no merge rule turns into one value: a non-tensor (or a
    ``_Replicate`` leaf) that differs between microbatches, outputs of different structures,
    a tensor beside a non-tensor at one position. The message names the output path.

    Example:
        >>> merge_microbatches([{"n": 1}, {"n": 2}])
        Traceback (most recent call last):
        ...
        roundpipe.runtime.batch.MicrobatchMergeError: output['n'] differs between microbatches (1 in microbatch 0, 2 in microbatch 1): a non-tensor output is merged only when every microbatch returns the same value; return it as a tensor or pass merge_output=<callable> (or a spec) to merge it yourself
    """


# -- transfer events --------------------------------------------------------------------------
def _check_event(event: Any, what: str) -> None:
    """Events are waited on by :func:`wait_transfer_event`: anything else is refused early."""
    if event is None or isinstance(event, threading.Event):
        return
    if not callable(getattr(event, "synchronize", None)):
        raise RoundPipeTypeError(
            f"{what} must be None or an event with synchronize() (a CUDA / torch event, a "
            f"roundpipe CopyEvent) or a threading.Event, got {type(event).__name__}"
        )


def wait_transfer_event(
    event: Any, what: str = "a transfer", state: RunState | None = None
) -> None:
    """Block until ``event`` completed; ``None`` is an event that already did.

    ``event`` is a CUDA / torch event or a :class:`~roundpipe.devices.link.CopyEvent` (its
    ``synchronize()`` is called) or a ``threading.Event`` (waited on, aborting when ``state``
    reports a failure elsewhere).

    Example:
        >>> ev = threading.Event(); ev.set(); wait_transfer_event(ev)
        >>> wait_transfer_event(None)
    """
    if event is None:
        return
    if isinstance(event, threading.Event):
        wait_event(event, what, state=state)
        return
    event.synchronize()


def _event_pair(recorded: tuple[Any, Any] | None) -> tuple[Any, Any]:
    """The (forward, backward) events packed outputs carry for one microbatch: what the last
    stage recorded, completed by real events where it recorded none. No backward event (no
    backward ran in this model) means the consumer's backward reads the same host data its
    forward did: the forward event guards both."""
    fwd, bwd = recorded if recorded is not None else (None, None)
    if fwd is None:
        fwd = CpuEvent()  # nothing in flight: an event never recorded is complete
    return fwd, (fwd if bwd is None else bwd)


class RoundPipePackedData(list):
    """Per-microbatch values kept apart so the next RoundPipe model can consume them directly.

    Returned (one per output leaf) by ``forward`` when ``merge_output=False``; passing it as an
    argument of another RoundPipe model reuses the same microbatches (and keeps autograd links).
    ``transfer_event[m]`` is ``(forward_event, backward_event)`` for microbatch ``m`` (or
    ``None``: nothing to wait for): the consumer's forward waits on ``forward_event`` before it
    reads the value, its backward (which reads the value again to recompute) on
    ``backward_event``.

    Example:
        >>> packed = RoundPipePackedData([torch.ones(2), torch.zeros(2)], [None, None])
        >>> len(packed), packed.transfer_event
        (2, [(None, None), (None, None)])
    """

    def __init__(self, data: list[Any], transfer_event: list[Any]) -> None:
        super().__init__(data)
        if not isinstance(transfer_event, (list, tuple)) or len(transfer_event) != len(self):
            raise RoundPipeValueError(
                f"transfer_event must be a list with one (forward_event, backward_event) per "
                f"microbatch ({len(self)}), got {transfer_event!r}"
            )
        events: list[tuple[Any, Any]] = []
        for m, ev in enumerate(transfer_event):
            pair = (None, None) if ev is None else ev
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise RoundPipeTypeError(
                    f"transfer_event[{m}] must be None or a (forward_event, backward_event) "
                    f"pair, got {ev!r}"
                )
            for e, kind in zip(pair, ("forward", "backward")):
                _check_event(e, f"transfer_event[{m}]'s {kind} event")
            events.append((pair[0], pair[1]))
        self.transfer_event: list[tuple[Any, Any]] = events

    def synchronize(self) -> None:
        """Block until every microbatch's data has reached the host (its forward events)."""
        for fwd, _ in self.transfer_event:
            wait_transfer_event(fwd, "packed data on the host")


# a packed value is one leaf (not a list node) when flattening arguments
def _is_leaf(x: Any) -> bool:
    return isinstance(x, RoundPipePackedData)


# public from torch 2.6 on; the private spelling before (it warns from 2.13 on)
_tree_is_leaf = getattr(pytree, "tree_is_leaf", None) or pytree._is_leaf


def _leaf_paths(tree: Any, root: str, is_leaf: Callable[[Any], bool] | None = None) -> list[str]:
    """Readable paths of ``tree``'s leaves, in pytree leaf order, for error messages.

    Types registered without key paths (``register_pytree_node`` with no
    ``flatten_with_keys_fn``, as the user guide registers them) get ``.TypeName[i]``.

    Example:
        >>> _leaf_paths(((torch.ones(1), None), {"mask": 1}), "input")
        ['input[0][0]', 'input[0][1]', "input[1]['mask']"]
    """
    out: list[str] = []

    def walk(x: Any, path: str) -> None:
        if _tree_is_leaf(x, is_leaf):
            out.append(path)
            return
        for suffix, child in _children(x)[0]:
            walk(child, path + suffix)

    walk(tree, root)
    return out


def _children(node: Any) -> tuple[list[tuple[str, Any]], Any]:
    """A pytree node's (path suffix, child) pairs and its context."""
    node_def = pytree.SUPPORTED_NODES[pytree._get_node_type(node)]
    children, context = node_def.flatten_fn(node)
    if node_def.flatten_with_keys_fn is not None:
        keyed = node_def.flatten_with_keys_fn(node)[0]
        return [(pytree.keystr((k,)), c) for k, c in keyed], context
    return [(f".{type(node).__name__}[{i}]", c) for i, c in enumerate(children)], context


def _first_difference(a: Any, b: Any, path: str, m: int) -> str:
    """Where output ``b`` (of microbatch ``m``) first departs from ``a``'s (microbatch 0's)
    structure: a path and what differs there (a type, or a context such as dict keys or a
    registered type's non-tensor fields)."""
    if _tree_is_leaf(a) or _tree_is_leaf(b) or type(a) is not type(b):
        return (
            f"{path} is a {type(a).__name__} in microbatch 0 but a {type(b).__name__} in "
            f"microbatch {m}"
        )
    kids_a, ctx_a = _children(a)
    kids_b, ctx_b = _children(b)
    if ctx_a != ctx_b or len(kids_a) != len(kids_b):
        return (
            f"{path} ({type(a).__name__}) holds {_short(ctx_a)} in microbatch 0 but "
            f"{_short(ctx_b)} in microbatch {m}"
        )
    for (suffix, ca), (_, cb) in zip(kids_a, kids_b):
        if pytree.tree_structure(ca) != pytree.tree_structure(cb):
            return _first_difference(ca, cb, path + suffix, m)
    return f"{path} differs in structure between microbatch 0 and microbatch {m}"


def _input_paths(args: tuple, kwargs: dict[str, Any]) -> list[str]:
    """Leaf paths of ``(args, kwargs)`` as the caller wrote them: ``args[0]``, ``kwargs['m']``."""
    return _leaf_paths(tuple(args), "args", _is_leaf) + _leaf_paths(
        dict(kwargs), "kwargs", _is_leaf
    )


def _replicated_anyway(leaf: Any) -> bool:
    """``None`` and 0-d tensors have nothing to split: every microbatch gets them as they are,
    whatever spec covers them (a spec prefix covering a subtree reaches them too)."""
    return leaf is None or (isinstance(leaf, torch.Tensor) and leaf.ndim == 0)


# -- specs (the leaf checks live in roundpipe.runtime.split_spec) ---------------------------------
def _num_leaves(data: Any) -> int:
    return len(pytree.tree_leaves(data, is_leaf=_is_leaf))


def _broadcast_spec(spec: Any, data: Any, name: str, for_merge: bool, path: str = "") -> list[Any]:
    """One spec entry per leaf of ``data``: ``spec`` mirrors ``data`` or a prefix of it (a spec
    leaf covers the whole subtree below it), in ``data``'s own leaf order."""
    where = path or "the top level"
    if _is_spec_leaf(spec, for_merge):
        return [spec] * _num_leaves(data)
    if _is_leaf(data) or pytree.tree_structure(data, is_leaf=_is_leaf).is_leaf():
        raise RoundPipeValueError(
            f"{name}: the spec has a {type(spec).__name__} at {where} where the data has a "
            f"{type(data).__name__}; the spec must mirror the data structure"
        )
    out: list[Any] = []
    if isinstance(spec, Mapping) and isinstance(data, Mapping):
        if set(spec) != set(data):
            raise RoundPipeValueError(
                f"{name}: the spec's keys at {where} are {sorted(map(str, spec))} but the data's "
                f"are {sorted(map(str, data))}"
            )
        for k in data:  # pytree's leaf order: the data's key order
            out += _broadcast_spec(spec[k], data[k], name, for_merge, f"{path}[{k!r}]")
        return out
    if isinstance(spec, (list, tuple)) and isinstance(data, (list, tuple)):
        if len(spec) != len(data):
            raise RoundPipeValueError(
                f"{name}: the spec has {len(spec)} entries at {where} but the data has "
                f"{len(data)}; the spec must mirror the data structure"
            )
        for i, (s, d) in enumerate(zip(spec, data)):
            out += _broadcast_spec(s, d, name, for_merge, f"{path}[{i}]")
        return out
    node = pytree.SUPPORTED_NODES.get(type(data))
    if node is not None and type(spec) is type(data):  # other registered containers
        s_children, s_ctx = node.flatten_fn(spec)
        d_children, d_ctx = node.flatten_fn(data)
        if s_ctx == d_ctx and len(s_children) == len(d_children):
            for i, (s, d) in enumerate(zip(s_children, d_children)):
                out += _broadcast_spec(s, d, name, for_merge, f"{path}.<{i}>")
            return out
    raise RoundPipeValueError(
        f"{name}: the spec has a {type(spec).__name__} at {where} where the data has a "
        f"{type(data).__name__}; the spec must mirror the data structure"
    )


def _normalize_split_leaf(s: Any) -> Any:
    if s is None or s is _Replicate or isinstance(s, _Replicate):
        return REPLICATE
    if isinstance(s, int):
        return TensorChunkSpec(s)
    return s


def _spec_from_user(spec: Any, data: Any, name: str) -> list[Any]:
    """Flatten a user split spec to one ``TensorChunkSpec`` / ``_Replicate`` per data leaf."""
    check_spec(spec, name)
    return [_normalize_split_leaf(s) for s in _broadcast_spec(spec, data, name, for_merge=False)]


def _packed_rows(packed: Sequence[RoundPipePackedData]) -> list[int] | None:
    """Batch rows of each microbatch of packed data: dim 0 of its first batched tensor leaf."""
    for p in packed:
        if all(isinstance(t, torch.Tensor) and t.ndim > 0 for t in p):
            return [t.shape[0] for t in p]
    return None


def guess_split_spec(data: Any, expected_batchsize: int | None = None) -> tuple[Any, int | None]:
    """Infer a split spec for ``data``: tensors with the batch size on dim 0 are chunked.

    The batch size is ``expected_batchsize``, else the total rows of packed inputs
    (:class:`RoundPipePackedData`, already split: chunked as they are), else the most common
    dim-0 size among tensors. Other tensors and non-tensors are replicated.

    Example:
        >>> spec, bs = guess_split_spec((torch.ones(4, 3), torch.ones(7), "x"))
        >>> bs, [type(s).__name__ for s in spec]
        (4, ['TensorChunkSpec', '_Replicate', '_Replicate'])
    """
    leaves, treespec = pytree.tree_flatten(data, is_leaf=_is_leaf)
    sizes = [t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.ndim > 0]
    bs = expected_batchsize
    if bs is None:
        rows = _packed_rows([x for x in leaves if isinstance(x, RoundPipePackedData)])
        if rows is not None:
            bs = sum(rows)
            sizes.append(bs)
    if bs is None and sizes:
        bs = collections.Counter(sizes).most_common(1)[0][0]
    spec_leaves = [
        TensorChunkSpec(0)
        if isinstance(t, RoundPipePackedData)
        or (isinstance(t, torch.Tensor) and t.ndim > 0 and bs is not None and t.shape[0] == bs)
        else REPLICATE
        for t in leaves
    ]
    if bs is not None and bs not in sizes:
        bs = None
    return pytree.tree_unflatten(spec_leaves, treespec), bs


def _split_spec_leaves(spec: Any) -> list[Any]:
    return pytree.tree_leaves(spec, is_leaf=lambda x: isinstance(x, (TensorChunkSpec, _Replicate)))


def split_by_spec(
    data: Any,
    spec_leaves: list[Any],
    n: int,
    rows: Sequence[int] | None = None,
    paths: Sequence[str] | None = None,
) -> list[Any]:
    """Split ``data`` into ``n`` pytrees following flattened ``spec_leaves``.

    Packed leaves hand out their own microbatches; ``None`` and 0-d tensors are replicated
    whatever their spec. ``rows`` (the batch rows of each microbatch, e.g. those of packed
    inputs) sets the chunk sizes of tensors split on dim 0 whose size is their sum, so they line
    up with the packed microbatches; other chunked tensors follow ``torch.tensor_split`` (sizes
    that do not divide by ``n`` give the first microbatches one row more). ``paths`` names the
    leaves in error messages.

    Example:
        >>> [t.tolist() for t in split_by_spec(torch.arange(4), [TensorChunkSpec(0)], 2)]
        [[0, 1], [2, 3]]
        >>> [t.tolist() for t in split_by_spec(torch.arange(4), [TensorChunkSpec(0)], 2, [3, 1])]
        [[0, 1, 2], [3]]
        >>> [t.tolist() for t in split_by_spec(torch.arange(5), [TensorChunkSpec(0)], 2)]
        [[0, 1, 2], [3, 4]]
    """
    leaves, treespec = pytree.tree_flatten(data, is_leaf=_is_leaf)
    per_mb: list[list[Any]] = [[] for _ in range(n)]
    for j, (leaf, s) in enumerate(zip(leaves, spec_leaves)):
        where = paths[j] if paths is not None else f"leaf {j}"
        if isinstance(leaf, RoundPipePackedData):
            if len(leaf) != n:
                raise RoundPipeValueError(
                    f"{where}: packed data has {len(leaf)} microbatches but {n} are in use"
                )
            for i in range(n):
                per_mb[i].append(leaf[i])
        elif isinstance(s, TensorChunkSpec) and not _replicated_anyway(leaf):
            if not isinstance(leaf, torch.Tensor):
                raise RoundPipeValueError(
                    f"{where}: cannot split a {type(leaf).__name__} with {s}; mark it "
                    "_Replicate (or None) in the spec"
                )
            dim = s.split_dim
            if not -leaf.ndim <= dim < leaf.ndim:
                raise RoundPipeValueError(
                    f"{where}: cannot split a tensor of shape {tuple(leaf.shape)} with {s}"
                )
            if leaf.shape[dim] < n:
                raise RoundPipeValueError(
                    f"{where}: cannot split a tensor with size {leaf.shape[dim]} on dim "
                    f"{dim} into {n} microbatches"
                )
            if _follows_rows(leaf, dim, rows):
                chunks = torch.split(leaf, list(rows or ()), dim=0)
            else:
                chunks = torch.tensor_split(leaf, n, dim=dim)
            for i, chunk in enumerate(chunks):
                per_mb[i].append(chunk)
        else:
            for i in range(n):
                per_mb[i].append(leaf)
    return [pytree.tree_unflatten(mb, treespec) for mb in per_mb]


def _follows_rows(leaf: torch.Tensor, dim: int, rows: Sequence[int] | None) -> bool:
    """Whether a tensor chunked on ``dim`` takes the given per-microbatch ``rows``."""
    return rows is not None and dim in (0, -leaf.ndim) and leaf.shape[0] == sum(rows)


def _warn_uneven(
    data: Any,
    spec_leaves: list[Any],
    n: int,
    rows: Sequence[int] | None,
    paths: Sequence[str],
    name: str,
) -> None:
    """Warn (once per split) when chunked tensors do not divide into ``n`` equal microbatches.

    The split still happens (``torch.tensor_split``: the first ``size % n`` microbatches get one
    row more) and merged outputs equal the whole batch's; what changes is a ``loss_fn`` that
    averages per microbatch and divides by ``num_microbatch``: it no longer weighs every row
    the same.
    """
    uneven: dict[tuple[int, int], list[str]] = {}
    leaves = pytree.tree_leaves(data, is_leaf=_is_leaf)
    for leaf, s, where in zip(leaves, spec_leaves, paths):
        if (
            isinstance(s, TensorChunkSpec)
            and isinstance(leaf, torch.Tensor)
            and not _replicated_anyway(leaf)
            and -leaf.ndim <= s.split_dim < leaf.ndim
            and not _follows_rows(leaf, s.split_dim, rows)
            and leaf.shape[s.split_dim] % n
        ):
            uneven.setdefault((leaf.shape[s.split_dim], s.split_dim), []).append(where)
    if not uneven:
        return
    parts = []
    for (size, dim), where in uneven.items():
        q, r = divmod(size, n)  # torch.tensor_split's sizes
        sizes = [q + 1] * r + [q] * (n - r)
        parts.append(f"size {size} ({', '.join(where)}, dim {dim}) splits into {sizes}")
    warnings.warn(
        f"{name}: the batch does not divide into {n} microbatches: {'; '.join(parts)} "
        "(torch.tensor_split). Merged outputs equal the whole batch's, but a per-microbatch "
        "mean loss divided by num_microbatch no longer weighs every row the same: use a batch "
        f"size divisible by {n} for the whole-batch mean.",
        UserWarning,
        stacklevel=_caller_stacklevel(),
    )


_INTERNAL_DIRS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # roundpipe
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,  # nn.Module.__call__
)


def _caller_stacklevel() -> int:
    """``warnings.warn``'s stacklevel (from its caller) that points at the user's line: the
    first frame outside roundpipe and torch."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _split(
    data: Any,
    user_spec: Any,
    n_wanted: int,
    name: str,
    expected_bs: int | None,
    paths: Sequence[str],
) -> tuple[list[Any], int, str | None, list[int] | None]:
    """Split ``data``; returns (microbatches, actual count, why it differs from ``n_wanted``,
    batch rows per microbatch or None when unknown). ``paths`` names ``data``'s leaves."""
    leaves = pytree.tree_leaves(data, is_leaf=_is_leaf)
    packed = [x for x in leaves if isinstance(x, RoundPipePackedData)]
    n = n_wanted
    reason = None
    packed_rows = None
    if packed:
        n = len(packed[0])
        if any(len(p) != n for p in packed):
            raise RoundPipeValueError(
                f"packed inputs hold different numbers of microbatches: {[len(p) for p in packed]}"
            )
        reason = f"the packed input holds {n} microbatches"
        packed_rows = _packed_rows(packed)
    if user_spec is None:
        if expected_bs is None and packed_rows is not None:
            expected_bs = sum(packed_rows)
        spec, bs = guess_split_spec(data, expected_bs)
        spec_leaves = _split_spec_leaves(spec)
        if bs is None and not packed:
            n, reason = 1, "no input tensor has a batch dimension"
        elif bs is not None and not packed and bs < n:
            n, reason = bs, f"the batch has only {bs} rows"
    else:
        spec_leaves = _spec_from_user(user_spec, data, name)
    _warn_uneven(data, spec_leaves, n, packed_rows, paths, name)
    mbs = split_by_spec(data, spec_leaves, n, packed_rows, paths)
    rows = packed_rows if packed else _rows(mbs, spec_leaves)
    return mbs, n, (reason if n != n_wanted else None), rows


def _rows(mbs: list[Any], spec_leaves: list[Any]) -> list[int] | None:
    """Batch rows of each microbatch: the size of the first split tensor along its split dim."""
    flat = [pytree.tree_leaves(mb, is_leaf=_is_leaf) for mb in mbs]
    for j, s in enumerate(spec_leaves):
        if isinstance(s, TensorChunkSpec):
            leaves = [f[j] for f in flat]
            if all(isinstance(t, torch.Tensor) for t in leaves) and not any(
                _replicated_anyway(t) for t in leaves
            ):
                return [t.shape[s.split_dim] for t in leaves]
            if not all(_replicated_anyway(t) for t in leaves):
                return None
    return None


def _custom_split_input(args: tuple, kwargs: dict[str, Any], fn: Callable, n: int) -> list[Any]:
    """Call a ``split_input`` function; it returns ``(args_list, kwargs_list)`` (one entry per
    microbatch in each) or a list of ``(args, kwargs)`` pairs."""
    out = fn(args, kwargs, n)
    if (  # (args_list, kwargs_list): the kwargs side is a sequence of dicts, never one dict
        isinstance(out, (list, tuple))
        and len(out) == 2
        and isinstance(out[0], (list, tuple))
        and isinstance(out[1], (list, tuple))
        and all(isinstance(k, Mapping) for k in out[1])
    ):
        args_list, kwargs_list = out
        if len(args_list) != len(kwargs_list) or not args_list:
            raise MicrobatchSplitError(
                f"split_input returned {len(args_list)} args and {len(kwargs_list)} kwargs "
                "entries: (args_list, kwargs_list) needs one of each per microbatch (at least 1)"
            )
        pairs = list(zip(args_list, kwargs_list))
    elif (
        isinstance(out, (list, tuple))
        and out
        and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in out)
    ):
        pairs = [tuple(p) for p in out]
    else:
        raise MicrobatchSplitError(
            "split_input must return (args_list, kwargs_list) or a non-empty list of "
            f"(args, kwargs) pairs, got {type(out).__name__}: {out!r:.200}"
        )
    for m, (a, k) in enumerate(pairs):
        if not isinstance(a, (list, tuple)) or not isinstance(k, Mapping):
            raise MicrobatchSplitError(
                f"split_input: microbatch {m} must be (tuple of args, dict of kwargs), got "
                f"({type(a).__name__}, {type(k).__name__})"
            )
    return [(tuple(a), dict(k)) for a, k in pairs]


# -- merging ----------------------------------------------------------------------------------
class AvgReducer(_CustomReducer):
    """Running average of scalar losses across microbatches (one reduction at a time).

    A ``torch.distributed.pipelining`` reducer: usable as a merge spec leaf.

    Example:
        >>> r = AvgReducer(); v = r.reduce(None, torch.tensor(1.0)); r.reduce(v, torch.tensor(3.0))
        tensor(2.)
    """

    def __init__(self) -> None:
        super().__init__(None, self.reduce)
        self.sum: torch.Tensor | None = None
        self.count = 0
        self._last: torch.Tensor | None = None

    def reduce(self, reduced_val: torch.Tensor | None, new_val: torch.Tensor) -> torch.Tensor:
        """Fold ``new_val`` into the average; ``reduced_val=None`` starts a new reduction.

        Raises:
            AssertionError: ``reduced_val`` is not what this reducer returned last, i.e. two
                reductions use the same instance at the same time.
        """
        if reduced_val is None:
            self.sum, self.count = None, 0
        elif reduced_val is not self._last or self.sum is None:
            raise AssertionError("AvgReducer used by two reductions at the same time")
        # no detach: a merged loss stays differentiable
        self.sum = new_val if self.sum is None else self.sum + new_val
        self.count += 1
        self._last = self.sum / self.count
        return self._last


avg_reducer = AvgReducer()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
        )
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. arrays: compare by identity
        return a is b


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _differs(path: str, vals: list[Any], why: str) -> MicrobatchMergeError:
    """The error for a leaf whose microbatches disagree: names the path and the values."""
    m = next(i for i, v in enumerate(vals) if not _same(v, vals[0]))
    return MicrobatchMergeError(
        f"{path} differs between microbatches ({_short(vals[0])} in microbatch 0, "
        f"{_short(vals[m])} in microbatch {m}): {why}"
    )


def _average_scalars(vals: list[torch.Tensor], weights: list[float] | None) -> torch.Tensor:
    """The average of 0-d tensors, weighted by ``weights`` (batch rows) when given.

    A value every microbatch agrees on (a replicated input handed back, a constant) is
    returned as given, dtype and all: its average. Values that carry gradients are always
    averaged, so each microbatch's graph gets its share of the gradient. Integer and bool
    values that differ average in the default float dtype.
    """
    v0 = vals[0]
    if not any(v.requires_grad for v in vals) and all(_same(v, v0) for v in vals[1:]):
        return v0
    stacked = torch.stack(vals)
    if not (stacked.is_floating_point() or stacked.is_complex()):
        stacked = stacked.to(torch.get_default_dtype())
    if weights is None:
        return stacked.mean(0)
    w = torch.tensor(weights, dtype=stacked.dtype, device=stacked.device)
    return (stacked * w).sum(0) / w.sum()


def _auto_merge(vals: list[Any], weights: list[float] | None, path: str) -> Any:
    """Default merge of one leaf's per-microbatch values (the user guide's rules)."""
    tensors = [isinstance(v, torch.Tensor) for v in vals]
    if any(tensors) and not all(tensors):
        m = tensors.index(not tensors[0])
        raise MicrobatchMergeError(
            f"{path} is a {type(vals[0]).__name__} in microbatch 0 but a "
            f"{type(vals[m]).__name__} in microbatch {m}; every microbatch must return the same "
            "kind of value there (or pass merge_output=<callable>)"
        )
    if all(tensors):
        batched = [v.ndim > 0 for v in vals]
        if all(batched):  # the batch dimension: concatenated, differentiably
            return torch.cat(vals, 0)
        if not any(batched):  # scalars (a loss, a replicated value): averaged
            return _average_scalars(vals, weights)
        raise MicrobatchMergeError(
            f"{path} is a 0-d tensor in some microbatches and batched in others "
            f"(shapes {[tuple(v.shape) for v in vals]}); pass merge_output=<callable>"
        )
    # plain Python values (ints, strings, None, ...): kept once when every microbatch agrees
    if all(_same(v, vals[0]) for v in vals[1:]):
        return vals[0]
    raise _differs(
        path,
        vals,
        "a non-tensor output is merged only when every microbatch returns the same value; "
        "return it as a tensor or pass merge_output=<callable> (or a spec) to merge it yourself",
    )


def _spec_merge(vals: list[Any], spec: Any, path: str) -> Any:
    if all(v is None for v in vals):  # an absent optional output stays absent
        return None
    if isinstance(spec, TensorChunkSpec):
        if not all(isinstance(v, torch.Tensor) and v.ndim > 0 for v in vals):
            raise MicrobatchMergeError(
                f"merge_output: {path} is not a batched tensor in every microbatch "
                f"({[_short(v) for v in vals]}), so {spec} cannot concatenate it"
            )
        return torch.cat(vals, spec.split_dim)
    if isinstance(spec, _CustomReducer):
        acc = spec.init_value
        for v in vals:
            acc = spec.reduce_fn(acc, v)
        return acc
    # replicate: every microbatch must give the same value
    if all(_same(v, vals[0]) for v in vals[1:]):
        return vals[0]
    m = next(i for i, v in enumerate(vals) if not _same(v, vals[0]))
    raise MicrobatchMergeError(
        f"merge_output: {path} is replicated but microbatch {m} differs from microbatch 0 "
        f"({_short(vals[m])} vs {_short(vals[0])}); a _Replicate / None leaf needs the same value "
        "from every microbatch: use TensorChunkSpec or a reducer there"
    )


def merge_microbatches(
    outputs: Sequence[Any],
    device: torch.device | None = None,
    rows: Sequence[int] | None = None,
    spec: Any = None,
) -> Any:
    """Merge per-microbatch outputs leaf by leaf.

    Without ``spec`` (the user guide's default rules): tensors with a batch dim are
    concatenated on dim 0 (differentiably); 0-d tensors averaged (weighted by ``rows``, the
    batch rows of each microbatch, when microbatches differ in size, so a mean loss per
    microbatch merges into the mean over the whole batch), a value every microbatch agrees on
    coming back as given; non-tensors (``None`` included) kept once when every microbatch
    agrees, a :class:`MicrobatchMergeError` naming the output path otherwise.

    ``spec`` (a merge spec mirroring the output, or a prefix of it) overrides that per leaf:
    ``TensorChunkSpec(d)`` concatenates on ``d``, a reducer (``sum_reducer``,
    :data:`avg_reducer`) folds the values, ``_Replicate`` / ``None`` keeps a value every
    microbatch agrees on. A leaf that is ``None`` in every microbatch stays ``None``.

    Example:
        >>> merge_microbatches([(torch.ones(1), 2), (torch.zeros(1), 2)])
        (tensor([1., 0.]), 2)
        >>> merge_microbatches([torch.tensor(1.0), torch.tensor(4.0)], rows=[2, 1])
        tensor(2.)
        >>> merge_microbatches([torch.tensor(233), torch.tensor(233)])
        tensor(233)
        >>> merge_microbatches([torch.tensor(3), torch.tensor(4)])
        tensor(3.5000)
        >>> merge_microbatches([torch.ones(2, 1), torch.ones(2, 1)], spec=TensorChunkSpec(1)).shape
        torch.Size([2, 2])
    """
    if not outputs:
        raise RoundPipeValueError("merge_microbatches needs at least one microbatch output")
    if rows is not None and len(rows) != len(outputs):
        raise RoundPipeValueError(f"rows has {len(rows)} entries for {len(outputs)} microbatches")
    # equal sizes keep the plain mean (bit for bit what an unweighted merge gives)
    weights = None if rows is None or len(set(rows)) <= 1 else [float(r) for r in rows]
    flat = [pytree.tree_flatten(o) for o in outputs]
    treespec = flat[0][1]
    for m, (_, s) in enumerate(flat[1:], 1):
        if s != treespec:
            raise MicrobatchMergeError(
                f"microbatch {m}'s output has a different structure from microbatch 0's: "
                f"{_first_difference(outputs[0], outputs[m], 'output', m)} (a registered "
                "type's context, e.g. a non-tensor field, is part of the structure and must "
                "be equal); return the same structure from every microbatch, or pass "
                "merge_output=<callable>"
            )
    paths = _leaf_paths(outputs[0], "output")
    spec_leaves = None
    if spec is not None:
        check_spec(spec, "merge_output", for_merge=True)
        spec_leaves = _broadcast_spec(spec, outputs[0], "merge_output", for_merge=True)
    merged = []
    for i, path in enumerate(paths):
        vals = [f[0][i] for f in flat]
        if spec_leaves is None:
            out = _auto_merge(vals, weights, path)
        else:
            out = _spec_merge(vals, spec_leaves[i], path)
        if device is not None and isinstance(out, torch.Tensor):
            out = out.to(device)
        merged.append(out)
    return pytree.tree_unflatten(merged, treespec)


def pack_microbatches(outputs: Sequence[Any], transfer_event: list[Any]) -> Any:
    """The output pytree with, at each leaf, that leaf's per-microbatch values packed.

    Example:
        >>> packed = pack_microbatches([(torch.zeros(1), "a"), (torch.ones(1), "b")], [None] * 2)
        >>> [type(p).__name__ for p in packed], list(packed[1])
        (['RoundPipePackedData', 'RoundPipePackedData'], ['a', 'b'])
    """
    flat = [pytree.tree_flatten(o, is_leaf=_is_leaf) for o in outputs]
    treespec = flat[0][1]
    for m, (_, s) in enumerate(flat[1:], 1):
        if s != treespec:
            raise RoundPipeValueError(
                f"merge_output=False: microbatch {m}'s output structure differs from microbatch "
                f"0's ({s} vs {treespec}); it cannot be packed leaf by leaf"
            )
    packed = [
        RoundPipePackedData([f[0][i] for f in flat], list(transfer_event))
        for i in range(treespec.num_leaves)
    ]
    return pytree.tree_unflatten(packed, treespec)


class Batch:
    """Flattened microbatch state of one RoundPipe call.

    ``flatten_states[m]`` holds the leaves flowing between stages for microbatch ``m`` (the
    inputs at first, each stage's outputs afterwards) and ``flatten_specs[m]`` their structure.
    ``num_microbatch`` is the count actually made: fewer than configured when the batch has fewer
    rows (``count_mismatch`` then says why).

    ``forward_events[m]`` / ``backward_events[m]`` are the transfer events of packed inputs
    (:class:`RoundPipePackedData`) for microbatch ``m``: the first forward stage waits on the
    former before it reads the microbatch, the first backward stage on the latter before it
    reads it again. ``output_events[m]`` is the ``(forward, backward)`` pair the last forward
    stage recorded once microbatch ``m``'s outputs were on the host (``None`` until then).

    Example:
        >>> from roundpipe.run_config import FullRoundPipeRunConfig, RoundPipeRunConfig
        >>> cfg = FullRoundPipeRunConfig(RoundPipeRunConfig(num_microbatch=4), RoundPipeRunConfig())
        >>> b = Batch((torch.ones(2, 3),), {}, cfg)
        >>> b.num_microbatch, b.count_mismatch
        (2, 'the batch has only 2 rows')
    """

    def __init__(
        self,
        args: tuple,
        kwargs: dict[str, Any],
        run_config: FullRoundPipeRunConfig,
        label: Any = None,
    ) -> None:
        n = run_config.num_microbatch
        split_input = run_config.split_input
        if not is_spec(split_input):
            mbs = _custom_split_input(tuple(args), dict(kwargs), split_input, n)
            reason = f"split_input returned {len(mbs)} parts" if len(mbs) != n else None
            rows = None
        else:
            paths = _input_paths(tuple(args), dict(kwargs))
            mbs, _, reason, rows = _split(
                (tuple(args), dict(kwargs)), split_input, n, "split_input", None, paths
            )
        self.num_microbatch: int = len(mbs)
        # why fewer (or more) microbatches than run_config.num_microbatch were made; None if equal
        self.count_mismatch: str | None = reason
        # batch rows per microbatch (None if unknown): weights the merge of scalar outputs
        self.microbatch_rows: list[int] | None = rows
        flat = [pytree.tree_flatten(mb, is_leaf=_is_leaf) for mb in mbs]
        self.flatten_states: list[list[Any]] = [f[0] for f in flat]
        self.flatten_specs: list[Any] = [f[1] for f in flat]
        self.label_list: list[Any] = self._split_label(label, run_config.split_label)
        self.loss_list: list[Any] = [None] * self.num_microbatch
        self.forward_events: list[list[Any]] = [[] for _ in range(self.num_microbatch)]
        self.backward_events: list[list[Any]] = [[] for _ in range(self.num_microbatch)]
        packed = [
            x
            for x in pytree.tree_leaves((tuple(args), dict(kwargs)), is_leaf=_is_leaf)
            if isinstance(x, RoundPipePackedData)
        ]
        if packed and self.num_microbatch != len(packed[0]):
            raise MicrobatchSplitError(
                f"split_input made {self.num_microbatch} microbatches but the packed input "
                f"holds {len(packed[0])}"
            )
        for p in packed:
            for m, (fwd, bwd) in enumerate(p.transfer_event):
                if fwd is not None:
                    self.forward_events[m].append(fwd)
                if bwd is not None:
                    self.backward_events[m].append(bwd)
        self.output_events: list[tuple[Any, Any] | None] = [None] * self.num_microbatch

    def _split_label(self, label: Any, split_label: Any) -> list[Any]:
        n = self.num_microbatch
        if label is None:
            return [None] * n
        if not is_spec(split_label):
            out = split_label(label, n)
            if not isinstance(out, (list, tuple)) or len(out) != n:
                got = f"{len(out)} parts" if isinstance(out, (list, tuple)) else repr(out)[:200]
                raise MicrobatchSplitError(
                    f"split_label must return a list of {n} labels (one per microbatch), got {got}"
                )
            return list(out)
        if split_label is None:
            spec, _ = guess_split_spec(label, None)
            spec_leaves = _split_spec_leaves(spec)
        else:
            spec_leaves = _spec_from_user(split_label, label, "split_label")
        paths = _leaf_paths(label, "label", _is_leaf)
        _warn_uneven(label, spec_leaves, n, self.microbatch_rows, paths, "split_label")
        return split_by_spec(label, spec_leaves, n, self.microbatch_rows, paths)

    def wait_forward_events(self, m: int, state: RunState | None = None) -> None:
        """Block until microbatch ``m``'s packed inputs are on the host."""
        for ev in self.forward_events[m]:
            wait_transfer_event(ev, f"packed input of microbatch {m}", state)

    def wait_backward_events(self, m: int, state: RunState | None = None) -> None:
        """Block until microbatch ``m``'s packed inputs may be read by the backward."""
        for ev in self.backward_events[m]:
            wait_transfer_event(ev, f"packed input of microbatch {m} (backward)", state)

    def outputs(self) -> list[Any]:
        """Per-microbatch output pytrees (valid after the last forward stage)."""
        return [
            pytree.tree_unflatten(s, sp) for s, sp in zip(self.flatten_states, self.flatten_specs)
        ]

    def dump(self, run_config: FullRoundPipeRunConfig, outputs: list[Any] | None = None) -> Any:
        """Merge microbatch outputs, or pack them per output leaf when ``merge_output`` is False.

        Merging first waits for the outputs' transfer events (:attr:`output_events`); packing
        hands them on in each :class:`RoundPipePackedData` instead, a real (forward, backward)
        event pair per microbatch on every backend.
        """
        outs = self.outputs() if outputs is None else outputs
        merge: Any = run_config.merge_output
        events = [_event_pair(ev) for ev in self.output_events]
        if merge is False:
            return pack_microbatches(outs, events)
        for fwd, _ in events:
            wait_transfer_event(fwd, "microbatch outputs on the host")
        if not is_spec(merge, for_merge=True) and not isinstance(merge, bool):
            return merge(outs)
        dev = run_config.output_device
        spec = None if merge is True or merge is None else merge
        if len(outs) == 1 and spec is None:
            leaves, treespec = pytree.tree_flatten(outs[0])
            return pytree.tree_unflatten(
                [x.to(dev) if isinstance(x, torch.Tensor) else x for x in leaves], treespec
            )
        return merge_microbatches(outs, dev, self.microbatch_rows, spec)
