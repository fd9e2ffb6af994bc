"""Schedule primitives: importing this package registers the built-in ones."""

from . import annotate, checkpoint, fork_rng, replace, shard, sync  # noqa: F401  (registration)
from .base import Primitive, get_primitive, list_primitives, register_primitive
from .sync import register_sync_op

__all__ = [
    "Primitive",
    "get_primitive",
    "list_primitives",
    "register_primitive",
    "register_sync_op",
]
