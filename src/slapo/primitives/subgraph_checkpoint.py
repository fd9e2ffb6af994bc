"""``checkpoint(subgraph)``: recompute one part of a traced graph in backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from ..random import checkpoint as rng_checkpoint
from ..schedule import Schedule
from .subgraph_replace import replace_each


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
    return replace_each(
        sch,
        subgraph,
        "checkpoint",
        name,
        "CheckpointedSubgraph",
        lambda gm, owner: CheckpointedSubgraph(gm),
    )
