"""Tensor parallelism: shard specs, per-layer rules, autograd collectives, reshard specs,
vocabulary-parallel embedding and cross-entropy, and sequence-parallel helpers; context and
expert parallelism, and the one mesh of all five dimensions (``init_parallel_mesh``).

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

# (context_parallel and expert_parallel are also the names of their modules: import them from
# slapo.sharding.context_parallel / slapo.sharding.expert_parallel)
from .context_parallel import ContextParallel, ContextParallelError
from .expert_grads import reduce_expert_grads
from .expert_parallel import ExpertParallelError
from .groups import resolve_group
from .mesh import ParallelMesh, init_parallel_mesh
from .reshard import reshard as reshard_tensor
from .sequence import allreduce_sequence_parallel_grads, mark_sequence_parallel
from .spec import ShardSpec, get_shard_spec
from .vocab import vocab_parallel_cross_entropy

__all__ = [
    "CollectiveError",
    "ContextParallel",
    "ContextParallelError",
    "ExpertParallelError",
    "ParallelMesh",
    "ShardSpec",
    "all_gather",
    "all_reduce",
    "allreduce_sequence_parallel_grads",
    "count_collectives",
    "init_parallel_mesh",
    "mark_sequence_parallel",
    "vocab_parallel_cross_entropy",
    "get_shard_spec",
    "reduce_expert_grads",
    "reduce_scatter",
    "reshard_tensor",
    "resolve_group",
    "scatter",
]
