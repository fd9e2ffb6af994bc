"""Gradients of expert-parallel weights under data parallelism.

Expert parallelism (:mod:`.expert_parallel`) borrows its ranks from data parallelism (and
context parallelism): the ranks of an ep group hold *different* experts, so a data-parallel
engine must not average those weights' gradients over its group as it averages the replicated
ones. What each owner's gradient already is: the sum over every rank of its ep group of that
rank's loss gradient (the all-to-all brought every rank's tokens to it). What it must become: the
data-parallel mean, as for any other weight: summed over the *replicas* of those experts (the
ranks that hold the same experts in other ep groups) and divided by the size of the group the
engine averages over.

:func:`reduce_expert_grads` hooks each expert weight to do that as backward computes its gradient
(before it is accumulated, so gradient accumulation stays right) and tags it; the data-parallel
engines (DDP, the pipeline's replicas) leave tagged weights to their hooks
(:func:`data_parallel_params`, :func:`expert_param_names`).

Example (each rank; ``mesh`` holds the dp x cp layout)::

    expert_parallel(model, ep_group)
    reduce_expert_grads(model, replicas=expert_replicas_group, average_over=dp * cp)
    model = DDP(model, ...)  # with the tagged weights ignored: slapo.build(target="ddp") does it
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .collectives import all_reduce
from .expert_parallel import ExpertParallelError, is_expert_parameter
from .groups import group_size, resolve_group

__all__ = [
    "EXPERT_GRADS",
    "data_parallel_params",
    "expert_param_names",
    "is_reduced_by_hook",
    "reduce_expert_grads",
]

#: Tag of a parameter whose gradient :func:`reduce_expert_grads` reduces: data parallelism
#: must leave it alone.
EXPERT_GRADS = "_slapo_expert_grads"


def reduce_expert_grads(model: nn.Module, replicas: Any, average_over: int) -> list[str]:
    """Hook every expert weight of ``model``: its gradient is summed over ``replicas`` (the
    ranks holding the same experts; None or a group of one: no communication) and divided by
    ``average_over`` (the number of ranks the replicated weights' gradients are averaged over:
    dp x cp). Returns the hooked parameters' names.

    Example:
        >>> from slapo.testing import tiny_model
        >>> # a Qwen3-MoE model whose experts are sharded over expert-parallel ranks: not run here
        >>> model = tiny_model("qwen3_moe")  # doctest: +SKIP
        >>> reduce_expert_grads(model, replicas=None, average_over=2)  # doctest: +SKIP
        ['model.layers.0.mlp.experts.gate_up_proj', 'model.layers.0.mlp.experts.down_proj']
    """
    if not isinstance(average_over, int) or average_over < 1:
        raise ExpertParallelError(
            f"reduce_expert_grads: average_over must be a positive int, got {average_over!r}"
        )
    group = None if replicas is None else resolve_group(replicas, "reduce_expert_grads")
    summed = group is not None and group_size(group) > 1
    names = []
    for name, param in model.named_parameters():
        if not is_expert_parameter(model, name) or not param.requires_grad:
            continue
        if getattr(param, EXPERT_GRADS, False):
            raise ExpertParallelError(
                f'reduce_expert_grads: "{name}" is hooked already; call it once per model'
            )

        def reduce(grad: torch.Tensor, summed: bool = summed) -> torch.Tensor:
            if summed:
                grad = all_reduce(grad, group)
            return grad / average_over

        param.register_hook(reduce)
        setattr(param, EXPERT_GRADS, True)
        names.append(name)
    return names


def is_reduced_by_hook(param: torch.Tensor) -> bool:
    """Whether :func:`reduce_expert_grads` reduces ``param``'s gradient (data parallelism must
    not)."""
    return bool(getattr(param, EXPERT_GRADS, False))


def data_parallel_params(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters of ``params`` whose gradients data parallelism averages (all but the
    hooked expert weights).

    Example:
        >>> len(data_parallel_params(nn.Linear(2, 2).parameters()))
        2
    """
    return [p for p in params if not is_reduced_by_hook(p)]


def expert_param_names(model: nn.Module) -> list[str]:
    """The names of ``model``'s parameters that :func:`reduce_expert_grads` hooked (for DDP's
    ignore list).

    Example:
        >>> expert_param_names(nn.Linear(2, 2))
        []
    """
    return [name for name, p in model.named_parameters() if is_reduced_by_hook(p)]
