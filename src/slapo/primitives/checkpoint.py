"""``checkpoint``: recompute the module's activations in backward instead of keeping them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..exceptions import PrimitiveError
from ..random import checkpoint as rng_checkpoint
from .base import Primitive, register_primitive
from .wrapping import wrap_forward

if TYPE_CHECKING:
    from ..schedule import Schedule


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    # Checkpointing buys nothing when no graph is recorded (eval, no_grad); torch would warn.
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return rng_checkpoint(forward, *args, use_reentrant=False, **kwargs)


@register_primitive()
class CheckpointPrimitive(Primitive):
    """Activation checkpointing of the module: its inner activations are recomputed in backward.

    Non-reentrant, restores the RNG states (torch's and the ``fork_rng`` tracker's), so dropout
    masks match on recompute. Parameter names do not change. After ``trace``, pass a subgraph to
    checkpoint only that part of the graph.

    Example:
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
        >>> sch["0"].checkpoint()
    """

    name = "checkpoint"

    @staticmethod
    def apply(sch: Schedule, subgraph: Any = None, **kwargs: Any) -> None:
        if subgraph is not None:
            from . import subgraph_checkpoint

            return subgraph_checkpoint.checkpoint_subgraph(sch, subgraph, **kwargs)
        if kwargs:
            raise PrimitiveError(
                f'checkpoint() got unexpected arguments {sorted(kwargs)} on "{sch.path}"'
            )
        sch.require_unapplied("checkpoint")
        wrap_forward(sch.mod, "checkpoint", _checkpointed)
        return None
