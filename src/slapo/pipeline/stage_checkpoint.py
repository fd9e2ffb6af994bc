"""Activation checkpointing inside pipeline stages.

``partition_model`` traces the model without autograd (or with the model's own checkpoints
seeing no graph to save), so the ``checkpoint`` primitive's wrapper runs the plain forward and
the traced stages hold no checkpoint. The stages are unflattened, though: each module of the
user's model that a stage runs whole is a submodule of the stage under its own path
(``transformer.h.1``), called from its parent's graph. This module re-applies the schedule's
checkpoints there, with the policy each was given, so a stage saves what the unsplit model
would.

Example:
    >>> import torch, slapo
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    >>> sch = slapo.create_schedule(model)
    >>> sch["0"].checkpoint()
    >>> ckpts, partial = checkpointed_modules(sch)
    >>> ckpts, partial        # "0" checkpointed whole (None: the full policy)
    ({'0': None}, [])
    >>> checkpoint_stages([model], ckpts)   # a stage runs "0" whole: nothing missed
    []
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..primitives.checkpoint import resolve_policy
from ..primitives.fuse import _is_subgraph
from ..random import checkpoint as rng_checkpoint
from ..surgery import forward_wraps, wrap_forward

__all__ = ["checkpoint_stages", "checkpointed_modules"]

_KIND = "stage_checkpoint"


def checkpointed_modules(sch: Any) -> tuple[dict[str, Callable[..., Any] | None], list[str]]:
    """The module paths the schedule checkpoints whole, each with its policy (None: full).

    Returns the outermost checkpointed modules (an inner checkpoint is recomputed inside the
    outer one's recompute anyway) and, apart, the paths whose checkpoint covers only a traced
    subgraph, which the stages cannot re-apply.
    """
    whole: dict[str, Callable[..., Any] | None] = {}
    partial: list[str] = []
    for rec in sch.root.metadata.primitives:
        if rec.name != "checkpoint":
            continue
        first = rec.args[0] if rec.args else rec.kwargs.get("subgraph")
        if first is not None and _is_subgraph(first):
            partial.append(rec.path)
            continue
        policy = rec.kwargs.get("policy", first)  # checkpoint("save_matmuls") or policy=
        whole[rec.path] = resolve_policy(rec.path or "root", policy)
    outer = {
        p: f
        for p, f in whole.items()
        if not any(p != q and (q == "" or p.startswith(q + ".")) for q in whole)
    }
    return outer, partial


def _stage_checkpointed(policy: Callable[..., Any] | None) -> Callable[..., Any]:
    def run(forward: Any, *args: Any, **kwargs: Any) -> Any:
        # As the primitive: nothing to recompute when no graph is recorded (eval, no_grad).
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return rng_checkpoint(forward, *args, use_reentrant=False, policy=policy, **kwargs)

    return run


def checkpoint_stages(
    stages: Sequence[nn.Module], ckpts: dict[str, Callable[..., Any] | None]
) -> list[str]:
    """Checkpoint, in every stage, the submodule at each path of ``ckpts``; returns the paths
    that no stage runs as a whole module (the trace inlined them), which stay unprotected.

    A checkpointed module that a cut splits runs checkpointed in each stage holding a part.
    """
    missed = []
    for path, policy in ckpts.items():
        found = False
        for stage in stages:
            mod = _submodule(stage, path)
            if mod is None or not _is_call_target(stage, path):
                continue
            if _KIND not in forward_wraps(mod):
                wrap_forward(mod, _KIND, _stage_checkpointed(policy))
            found = True
        if not found:
            missed.append(path)
    return missed


def _submodule(stage: nn.Module, path: str) -> nn.Module | None:
    if not path:
        return stage  # the whole model checkpointed: each stage is a part of it
    try:
        return stage.get_submodule(path)
    except AttributeError:
        return None


def _is_call_target(stage: nn.Module, path: str) -> bool:
    """Whether some ancestor's graph calls the module at ``path`` (unflattening calls
    ``h.1`` from ``transformer``'s graph; a module kept only for its parameters is not called).
    """
    if not path:
        return True  # the stage itself: PipelineStage calls it
    parts = path.split(".")
    for i in range(len(parts)):
        ancestor = stage.get_submodule(".".join(parts[:i])) if i else stage
        graph = getattr(ancestor, "graph", None)
        if graph is None:
            if i == len(parts) - 1:
                return True  # a plain module runs its children from Python
            continue
        rel = ".".join(parts[i:])
        if any(n.op == "call_module" and n.target == rel for n in graph.nodes):
            return True
    return False
