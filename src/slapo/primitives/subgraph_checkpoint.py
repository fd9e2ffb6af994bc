"""``checkpoint(subgraph)``: recompute one part of a traced graph in backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from ..random import checkpoint as rng_checkpoint
from ..schedule import Schedule
from .subgraph_replace import replace_each


class CheckpointedSubgraph(nn.Module):
    """Runs an extracted subgraph under activation checkpointing (non-reentrant, RNG restored).

    The subgraph is held as a plain attribute, not a submodule: the modules it calls stay
    registered where they were in the traced module, so parameter names (and a state dict saved
    before scheduling) are unchanged, and ``.to()``/``train()`` reach them through their owner.
    """

    def __init__(self, graph_module: fx.GraphModule, policy: Any = None) -> None:
        super().__init__()
        object.__setattr__(self, "graph_module", graph_module)  # not registered: see above
        self.policy = policy  # None: recompute everything; else a selective-checkpoint policy

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing to save memory on (eval, no_grad)
            return self.graph_module(*args)
        return rng_checkpoint(self.graph_module, *args, use_reentrant=False, policy=self.policy)

    def extra_repr(self) -> str:
        calls = [str(n.target) for n in self.graph_module.graph.nodes if n.op == "call_module"]
        return f"calls={calls}" if calls else ""


def checkpoint_subgraph(
    sch: Schedule, subgraph: Any, name: str = "checkpoint", policy: Any = None
) -> list[str]:
    """Move each subgraph into its own module and checkpoint that module.

    Dropout masks are kept on recompute (RNG states are restored), so loss and gradients equal
    the uncheckpointed graph's. Parameter names do not change. ``policy``: a selective-checkpoint
    policy function (``slapo.random.checkpoint_policy``); None recomputes everything. Returns the
    new modules' names.

    Example:
        >>> import slapo
        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> from slapo.pattern import call_module
        >>> class MLP(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)
        ...     def forward(self, x):
        ...         return self.fc2(F.gelu(self.fc1(x)))
        >>> sch = slapo.create_schedule(nn.ModuleDict({"mlp": MLP()}))
        >>> found = sch["mlp"].find(lambda x: F.gelu(call_module("fc1", x)))  # traces by need
        >>> sch["mlp"].checkpoint(found)
        ['checkpoint']
    """
    return replace_each(
        sch,
        subgraph,
        "checkpoint",
        name,
        "CheckpointedSubgraph",
        lambda gm, owner: CheckpointedSubgraph(gm, policy),
        keep_called=True,
    )
