"""Microbatch split / merge of arbitrary argument pytrees.

RoundPipe flattens ``(args, kwargs)`` with :mod:`torch.utils._pytree`, splits every batched
tensor along its batch dimension (views, so autograd reaches the caller's tensors), and
replicates everything else. Outputs are merged back per leaf position.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from .run_config import FullRoundPipeRunConfig

__all__ = [
    "AvgReducer",
    "Batch",
    "RoundPipePackedData",
    "TensorChunkSpec",
    "avg_reducer",
    "guess_split_spec",
    "merge_microbatches",
    "split_by_spec",
]


class TensorChunkSpec:
    """Split spec leaf: chunk a tensor along ``split_dim``."""

    def __init__(self, split_dim: int) -> None:
        self.split_dim = split_dim

    def __repr__(self) -> str:
        return f"TensorChunkSpec({self.split_dim})"


class _Replicate:
    """Split spec leaf: give the same value to every microbatch."""

    def __repr__(self) -> str:
        return "Replicate"


REPLICATE = _Replicate()


class RoundPipePackedData(list):
    """Per-microbatch outputs kept apart so the next RoundPipe model can consume them directly.

    Returned by ``forward`` when ``merge_output=False``; passing it as an argument of
    another RoundPipe model reuses the same microbatches (and keeps autograd links).

    Example:
        >>> packed = RoundPipePackedData([torch.ones(2), torch.zeros(2)], [None, None])
        >>> len(packed)
        2
    """

    def __init__(self, data: list[Any], transfer_event: list[Any]) -> None:
        super().__init__(data)
        self.transfer_event = transfer_event

    def synchronize(self) -> None:
        """Block until every microbatch's data has reached the host."""
        for ev in self.transfer_event:
            if ev is not None:
                ev[0].synchronize() if isinstance(ev, tuple) else ev.synchronize()


# a packed value is one leaf (not a list node) when flattening arguments
def _is_leaf(x: Any) -> bool:
    return isinstance(x, RoundPipePackedData)


def guess_split_spec(data: Any, expected_batchsize: int | None = None) -> tuple[Any, int | None]:
    """Infer a split spec for ``data``: tensors with the batch size on dim 0 are chunked.

    The batch size is ``expected_batchsize`` or the most common dim-0 size among tensors.

    Example:
        >>> spec, bs = guess_split_spec((torch.ones(4, 3), torch.ones(7), "x"))
        >>> bs, spec
        (4, (TensorChunkSpec(0), Replicate, Replicate))
    """
    leaves, treespec = pytree.tree_flatten(data, is_leaf=_is_leaf)
    sizes = [t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.ndim > 0]
    bs = expected_batchsize
    if bs is None and sizes:
        bs = collections.Counter(sizes).most_common(1)[0][0]
    spec_leaves = [
        TensorChunkSpec(0)
        if isinstance(t, torch.Tensor) and t.ndim > 0 and bs is not None and t.shape[0] == bs
        else REPLICATE
        for t in leaves
    ]
    if bs is not None and bs not in sizes:
        bs = None
    return pytree.tree_unflatten(spec_leaves, treespec), bs


def _spec_from_user(spec: Any, data: Any, name: str) -> list[Any]:
    """Flatten a user spec (ints / None / TensorChunkSpec) to match ``data``'s leaves."""
    data_leaves, data_spec = pytree.tree_flatten(data, is_leaf=_is_leaf)
    spec_leaves, spec_spec = pytree.tree_flatten(
        spec, is_leaf=lambda x: x is None or isinstance(x, (int, TensorChunkSpec, _Replicate))
    )
    if len(spec_leaves) != len(data_leaves):
        raise ValueError(
            f"{name} has {len(spec_leaves)} leaves but the data has {len(data_leaves)}; "
            f"the spec must mirror the data structure ({data_spec})"
        )
    out = []
    for s in spec_leaves:
        if s is None or isinstance(s, _Replicate):
            out.append(REPLICATE)
        elif isinstance(s, TensorChunkSpec):
            out.append(s)
        elif isinstance(s, int) and not isinstance(s, bool):
            out.append(TensorChunkSpec(s))
        else:
            raise ValueError(f"{name}: spec leaves must be int, None or TensorChunkSpec, got {s!r}")
    return out


def split_by_spec(data: Any, spec_leaves: list[Any], n: int) -> list[Any]:
    """Split ``data`` into ``n`` pytrees following flattened ``spec_leaves``.

    Example:
        >>> [t.tolist() for t in split_by_spec(torch.arange(4), [TensorChunkSpec(0)], 2)]
        [[0, 1], [2, 3]]
    """
    leaves, treespec = pytree.tree_flatten(data, is_leaf=_is_leaf)
    per_mb: list[list[Any]] = [[] for _ in range(n)]
    for leaf, s in zip(leaves, spec_leaves):
        if isinstance(s, TensorChunkSpec):
            if not isinstance(leaf, torch.Tensor):
                raise ValueError(f"cannot split non-tensor {type(leaf).__name__} with {s}")
            if leaf.shape[s.split_dim] < n:
                raise ValueError(
                    f"cannot split a tensor with size {leaf.shape[s.split_dim]} on dim "
                    f"{s.split_dim} into {n} microbatches"
                )
            for i, chunk in enumerate(torch.tensor_split(leaf, n, dim=s.split_dim)):
                per_mb[i].append(chunk)
        elif isinstance(leaf, RoundPipePackedData):
            if len(leaf) != n:
                raise ValueError(f"packed data has {len(leaf)} microbatches but {n} are in use")
            for i in range(n):
                per_mb[i].append(leaf[i])
        else:
            for i in range(n):
                per_mb[i].append(leaf)
    return [pytree.tree_unflatten(mb, treespec) for mb in per_mb]


def _split(
    data: Any, user_spec: Any, n_wanted: int, name: str, expected_bs: int | None
) -> tuple[list[Any], int, str | None, list[int] | None]:
    """Split ``data``; returns (microbatches, actual count, why it differs from ``n_wanted``,
    batch rows per microbatch or None when unknown)."""
    if callable(user_spec):
        return [], -1, None, None  # handled by caller
    leaves = pytree.tree_leaves(data, is_leaf=_is_leaf)
    packed = [x for x in leaves if isinstance(x, RoundPipePackedData)]
    n = n_wanted
    reason = None
    if packed:
        n = len(packed[0])
        reason = f"the packed input holds {n} microbatches"
    if user_spec is None:
        spec, bs = guess_split_spec(data, expected_bs)
        spec_leaves = pytree.tree_flatten(
            spec, is_leaf=lambda x: isinstance(x, (TensorChunkSpec, _Replicate))
        )[0]
        if bs is None and not packed:
            n, reason = 1, "no input tensor has a batch dimension"
        elif bs is not None and not packed and bs < n:
            n, reason = bs, f"the batch has only {bs} rows"
    else:
        spec_leaves = _spec_from_user(user_spec, data, name)
    mbs = split_by_spec(data, spec_leaves, n)
    rows = None if packed else _rows(mbs, spec_leaves)
    return mbs, n, (reason if n != n_wanted else None), rows


def _rows(mbs: list[Any], spec_leaves: list[Any]) -> list[int] | None:
    """Batch rows of each microbatch: the size of the first split tensor along its split dim."""
    for j, s in enumerate(spec_leaves):
        if isinstance(s, TensorChunkSpec):
            leaves = [pytree.tree_leaves(mb, is_leaf=_is_leaf)[j] for mb in mbs]
            if all(isinstance(t, torch.Tensor) for t in leaves):
                return [t.shape[s.split_dim] for t in leaves]
            return None
    return None


class AvgReducer:
    """Running average of scalar losses across microbatches (one reduction at a time).

    Example:
        >>> r = AvgReducer(); v = r.reduce(None, torch.tensor(1.0)); r.reduce(v, torch.tensor(3.0))
        tensor(2.)
    """

    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None
        self.count = 0

    def reduce(self, reduced_val: torch.Tensor | None, new_val: torch.Tensor) -> torch.Tensor:
        """Fold ``new_val`` into the average; ``reduced_val=None`` starts a new reduction."""
        if reduced_val is None:
            self.sum, self.count = None, 0
        elif self.sum is None:
            raise AssertionError("AvgReducer used by two reductions at the same time")
        self.sum = new_val.detach().clone() if self.sum is None else self.sum + new_val.detach()
        self.count += 1
        return self.sum / self.count


avg_reducer = AvgReducer()


def merge_microbatches(
    outputs: Sequence[Any],
    device: torch.device | None = None,
    rows: Sequence[int] | None = None,
) -> Any:
    """Merge per-microbatch outputs leaf by leaf.

    Tensors with a batch dim are concatenated on dim 0 (differentiably), scalars averaged,
    equal non-tensors kept once, differing ones returned as a list. ``rows`` (the batch rows of
    each microbatch) weights the average when microbatches differ in size, so a mean loss per
    microbatch merges into the mean over the whole batch.

    Example:
        >>> merge_microbatches([(torch.ones(1), 2), (torch.zeros(1), 2)])
        (tensor([1., 0.]), 2)
        >>> merge_microbatches([torch.tensor(1.0), torch.tensor(4.0)], rows=[2, 1])
        tensor(2.)
    """
    if rows is not None and len(rows) != len(outputs):
        raise ValueError(f"rows has {len(rows)} entries for {len(outputs)} microbatches")
    # equal sizes keep the plain mean (bit for bit what an unweighted merge gives)
    weights = None if rows is None or len(set(rows)) <= 1 else [float(r) for r in rows]
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    for _, s in flat[1:]:
        if s != spec:
            raise ValueError(
                "microbatch outputs have different structures; pass merge_output=callable"
            )
    merged = []
    for i in range(len(flat[0][0])):
        vals = [f[0][i] for f in flat]
        if isinstance(vals[0], torch.Tensor):
            if vals[0].ndim > 0:
                out = torch.cat(vals, 0)
            elif weights is None or not (vals[0].is_floating_point() or vals[0].is_complex()):
                out = torch.stack(vals).mean(0)
            else:
                w = torch.tensor(weights, dtype=vals[0].dtype, device=vals[0].device)
                out = (torch.stack(vals) * w).sum(0) / w.sum()
            merged.append(out.to(device) if device is not None else out)
        elif all(v == vals[0] for v in vals[1:]):
            merged.append(vals[0])
        else:
            merged.append(list(vals))
    return pytree.tree_unflatten(merged, spec)


class Batch:
    """Flattened microbatch state of one RoundPipe call.

    ``flatten_states[m]`` holds the leaves flowing between stages for microbatch ``m`` (the
    inputs at first, each stage's outputs afterwards) and ``flatten_specs[m]`` their structure.
    ``num_microbatch`` is the count actually made: fewer than configured when the batch has fewer
    rows (``count_mismatch`` then says why).

    Example:
        >>> from roundpipe.run_config import RoundPipeRunConfig
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
        if callable(run_config.split_input):
            mbs = run_config.split_input(args, kwargs, n)
            if (
                not isinstance(mbs, (list, tuple))
                or not mbs
                or not all(isinstance(m, (list, tuple)) and len(m) == 2 for m in mbs)
            ):
                raise AssertionError(
                    "split_input callable must return a non-empty list of (args, kwargs)"
                )
            mbs = [(tuple(a), dict(k)) for a, k in mbs]
            reason = f"split_input returned {len(mbs)} parts" if len(mbs) != n else None
            rows = None
        else:
            mbs, _, reason, rows = _split(
                (tuple(args), dict(kwargs)), run_config.split_input, n, "split_input", None
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
        self.forward_events: list[Any] = [None] * self.num_microbatch
        self.backward_events: list[Any] = [None] * self.num_microbatch

    def _split_label(self, label: Any, split_label: Any) -> list[Any]:
        n = self.num_microbatch
        if label is None:
            return [None] * n
        if callable(split_label):
            out = list(split_label(label, n))
            if len(out) != n:
                raise AssertionError(f"split_label returned {len(out)} parts, expected {n}")
            return out
        if split_label is None:
            spec, _ = guess_split_spec(label, None)
            spec_leaves = pytree.tree_flatten(
                spec, is_leaf=lambda x: isinstance(x, (TensorChunkSpec, _Replicate))
            )[0]
        else:
            spec_leaves = _spec_from_user(split_label, label, "split_label")
        return split_by_spec(label, spec_leaves, n)

    def outputs(self) -> list[Any]:
        """Per-microbatch output pytrees (valid after the last forward stage)."""
        return [
            pytree.tree_unflatten(s, sp) for s, sp in zip(self.flatten_states, self.flatten_specs)
        ]

    def dump(self, run_config: FullRoundPipeRunConfig, outputs: list[Any] | None = None) -> Any:
        """Merge microbatch outputs, or pack them when ``merge_output`` is False."""
        outs = self.outputs() if outputs is None else outputs
        merge: bool | Callable = run_config.merge_output
        if merge is False:
            return RoundPipePackedData(outs, list(self.forward_events))
        if callable(merge) and not isinstance(merge, bool):
            return merge(outs)
        if len(outs) == 1:
            leaves, spec = pytree.tree_flatten(outs[0])
            dev = run_config.output_device
            return pytree.tree_unflatten(
                [x.to(dev) if isinstance(x, torch.Tensor) else x for x in leaves], spec
            )
        return merge_microbatches(outs, run_config.output_device, self.microbatch_rows)
