"""Schedule primitives: importing this package registers the built-in ones."""

from ..schedule import Primitive, get_primitive, list_primitives, register_primitive
from ..sharding.sync_ops import register_sync_op
from . import (  # noqa: F401  (importing registers the primitives)
    annotate,
    checkpoint,
    compile,
    cut_pipeline_stage,
    decompose,
    find,
    fork_rng,
    fuse,
    replace,
    shard,
    sync,
    trace,
)

__all__ = [
    "Primitive",
    "get_primitive",
    "list_primitives",
    "register_primitive",
    "register_sync_op",
]
