"""``checkpoint(subgraph)``: recompute one part of a traced graph in backward."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

from ..random import checkpoint as rng_checkpoint
from .subgraph_replace import check_closed, extract, normalize, owner_of, substitute

if TYPE_CHECKING:
    from ..schedule import Schedule


class CheckpointedSubgraph(nn.Module):
    """Runs an extracted subgraph under activation checkpointing (non-reentrant, RNG restored)."""

    def __init__(self, graph_module: fx.GraphModule) -> None:
        super().__init__()
        self.graph_module = graph_module

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing to save memory on (eval, no_grad)
            return self.graph_module(*args)
        return rng_checkpoint(self.graph_module, *args, use_reentrant=False)


def checkpoint_subgraph(sch: Schedule, subgraph: Any, name: str = "checkpoint") -> list[str]:
    """Move each subgraph into its own module and checkpoint that module.

    Dropout masks are kept on recompute (RNG states are restored), so loss and gradients equal
    the uncheckpointed graph's. Returns the new modules' names.

    Example:
        >>> sch.trace(tracer="fx", flatten=True)
        >>> sch.checkpoint(sch.find(lambda x: F.gelu(call_module("fc1", x))))
    """
    names = []
    for sub in normalize(sch, subgraph, "checkpoint"):
        owner = owner_of(sch, [sub], "checkpoint")
        check_closed(sub, "checkpoint")
        gm, inputs = extract(owner.mod, sub, "CheckpointedSubgraph")
        names.append(substitute(owner, [sub], CheckpointedSubgraph(gm), name, inputs))
    return names
