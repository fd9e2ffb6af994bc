"""Split and merge specs: what may stand at a leaf of ``split_input`` / ``split_label`` /
``merge_output`` (torch.distributed.pipelining's ``TensorChunkSpec``, ``_Replicate``, ``None``, a
split dim, or a reducer for merges).

Below :mod:`roundpipe.batch` and :mod:`roundpipe.run_config`: the run config checks its specs when
it is made, the batch applies them.
"""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate

from ..errors import RoundPipeTypeError

__all__ = ["check_spec", "is_spec"]


def _is_spec_leaf(x: Any, for_merge: bool = False) -> bool:
    """Whether ``x`` is a spec leaf (merge specs add reducers and take no plain ints)."""
    if x is None or x is _Replicate or isinstance(x, (TensorChunkSpec, _Replicate)):
        return True
    if for_merge:
        return isinstance(x, _CustomReducer)
    return isinstance(x, int) and not isinstance(x, bool)


def check_spec(spec: Any, name: str, for_merge: bool = False) -> None:
    """Raise ``TypeError`` unless every leaf of ``spec`` is a valid spec leaf.

    Example:
        >>> check_spec(((TensorChunkSpec(0), None), {"mask": 1}), "split_input")
        >>> from torch.distributed.pipelining.microbatch import sum_reducer
        >>> check_spec({"loss": sum_reducer, "logits": TensorChunkSpec(0)}, "merge_output", True)
        >>> check_spec(("cat",), "merge_output", True)
        Traceback (most recent call last):
        ...
        roundpipe.errors.RoundPipeTypeError: merge_output: a spec leaf must be TensorChunkSpec, _Replicate, None or a reducer (sum_reducer, avg_reducer), got 'cat'
    """
    leaves = pytree.tree_leaves(spec, is_leaf=lambda x: _is_spec_leaf(x, for_merge))
    allowed = "TensorChunkSpec, _Replicate, None or a reducer (sum_reducer, avg_reducer)"
    if not for_merge:
        allowed = "TensorChunkSpec, _Replicate, None or an int (the split dim)"
    for leaf in leaves:
        if not _is_spec_leaf(leaf, for_merge):
            raise RoundPipeTypeError(f"{name}: a spec leaf must be {allowed}, got {leaf!r}")


def is_spec(value: Any, for_merge: bool = False) -> bool:
    """Whether ``value`` is a spec (not a callable split / merge function).

    ``_Replicate`` is a class, hence callable: it is still a spec.

    Example:
        >>> is_spec(_Replicate), is_spec((0, None)), is_spec(lambda args, kwargs, n: [])
        (True, True, False)
    """
    return _is_spec_leaf(value, for_merge) or not callable(value)
