"""Tensor parallelism: shard specs, per-layer rules, autograd collectives, reshard specs,
vocabulary-parallel embedding and cross-entropy, and sequence-parallel helpers.

Importing this package registers the collectives and reshard specs as ``sync`` ops (``sync_ops``).
"""

from . import sync_ops  # noqa: F401  (registers the sync ops)
from .collectives import (
    CollectiveError,
    all_gather,
    all_reduce,
    count_collectives,
    reduce_scatter,
    scatter,
)
from .groups import resolve_group
from .reshard import reshard as reshard_tensor
from .sequence import allreduce_sequence_parallel_grads, mark_sequence_parallel
from .spec import ShardSpec, get_shard_spec
from .vocab import vocab_parallel_cross_entropy

__all__ = [
    "CollectiveError",
    "ShardSpec",
    "all_gather",
    "all_reduce",
    "allreduce_sequence_parallel_grads",
    "count_collectives",
    "mark_sequence_parallel",
    "vocab_parallel_cross_entropy",
    "get_shard_spec",
    "reduce_scatter",
    "reshard_tensor",
    "resolve_group",
    "scatter",
]
