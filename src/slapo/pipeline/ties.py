"""Tied weights split across pipeline stages: sum their gradients over the stages holding them.

After the split, a weight shared by two modules (GPT-2's ``wte`` and ``lm_head``) lives as one
copy per stage that uses it. Each copy gets a partial gradient; summing them over the holders
gives every copy the gradient of the shared weight, so identical optimizers keep them equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..tie_weights import analyze_tie_weights
from .replicas import local_part

__all__ = ["TieGroup", "find_tie_groups", "TiedGradSync"]


@dataclass
class TieGroup:
    """One tied weight: its names in the model and the stages that hold a copy."""

    names: frozenset[str]
    stages: list[int]
    group: dist.ProcessGroup | None = field(default=None, repr=False)


def find_tie_groups(model: nn.Module, stages: Sequence[nn.Module]) -> list[TieGroup]:
    """The tied weights of ``model`` (``analyze_tie_weights``) held by two or more stages.

    Example:
        >>> import torch, transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)
        >>> gpt2 = transformers.GPT2LMHeadModel(config)
        >>> ids = torch.zeros(2, 8, dtype=torch.long)
        >>> from slapo.pipeline.partition import partition_model
        >>> part = partition_model(gpt2, ["transformer.h.0"], (ids[:1],), {"use_cache": False})
        >>> stage_modules = part.stages
        >>> [sorted(t.names) for t in find_tie_groups(gpt2, stage_modules)]
        [['lm_head.weight', 'transformer.wte.weight']]
    """
    ties = []
    for found in analyze_tie_weights(model).values():
        names = frozenset(name for name, _ in found)
        holders = [i for i, s in enumerate(stages) if names & _param_names(s)]
        if len(holders) > 1:
            ties.append(TieGroup(names, holders))
    return ties


def _param_names(mod: nn.Module) -> set[str]:
    return {n for n, _ in mod.named_parameters(remove_duplicate=False)}


class TiedGradSync:
    """Sums the gradients of tied copies over the ranks holding them, after backward.

    ``pp_groups`` lists the global ranks of every pipeline group (one per tensor/data-parallel
    coordinate) so that each rank creates the same process groups in the same order, as
    ``new_group`` requires.
    """

    def __init__(
        self,
        ties: list[TieGroup],
        pp_groups: list[list[int]],
        stage_to_pp_rank: Callable[[int], int],
        local: dict[int, nn.Module],
    ) -> None:
        me = dist.get_rank()
        self.ties = ties
        self.local = local
        for tie in ties:
            for ranks in pp_groups:
                holders = sorted({ranks[stage_to_pp_rank(s)] for s in tie.stages})
                pg = dist.new_group(holders) if len(holders) > 1 else None
                if me in holders:
                    tie.group = pg

    def __call__(self) -> None:
        for tie in self.ties:
            params = self._local_params(tie)
            if not params:
                continue
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            # an FSDP2 replica holds the same shard of every copy (the same shape, the same
            # data-parallel mesh): the shards are summed as the whole tensors would be
            grads = [local_part(p.grad) for p in params]
            total = torch.stack(grads).sum(0)
            if tie.group is not None:
                dist.all_reduce(total, group=tie.group)
            for g in grads:
                g.copy_(total)

    def _local_params(self, tie: TieGroup) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for stage in self.local.values():
            for name, p in stage.named_parameters(remove_duplicate=False):
                if name in tie.names:
                    seen.setdefault(id(p), p)
        return list(seen.values())
