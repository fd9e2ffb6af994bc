"""Sequence parallelism: the activations between tensor-parallel regions are sharded on the sequence.

Megatron-style sequence parallelism replaces the all-reduce after a row-parallel layer with a
``reduce_scatter`` over the sequence, and the identity/all-reduce before a column-parallel region
with an ``all_gather`` over the sequence (whose backward reduce-scatters). With ``sync`` ops:

.. code-block:: python

    sch["attn"].sync(mode="fwd_pre", sync_op_or_fn="all_gather", dim=1, bwd="reduce_scatter")
    sch["attn.c_proj"].sync(mode="fwd_post", sync_op_or_fn="reduce_scatter", dim=1)

Norms and other replicated layers between the regions then see only a slice of the sequence, so
their parameters' gradients are partial: :func:`mark_sequence_parallel` tags them and
:func:`allreduce_sequence_parallel_grads` sums them over the group after backward, in one
collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .collectives import _record, run_collective
from .groups import resolve_group
from .spec import get_shard_spec

__all__ = ["mark_sequence_parallel", "allreduce_sequence_parallel_grads", "SP_TAG"]

SP_TAG = "sequence_parallel"


def mark_sequence_parallel(module: nn.Module) -> None:
    """Tag every replicated parameter of ``module`` (e.g. a norm, a row-parallel bias) as replicated inside a sequence-parallel region.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2)
        >>> model = transformers.GPT2LMHeadModel(config)
        >>> mark_sequence_parallel(model.transformer.h[0].ln_1)
    """
    for param in module.parameters():
        if get_shard_spec(param) is None:  # sharded parameters have full gradients already
            setattr(param, SP_TAG, True)


def allreduce_sequence_parallel_grads(model: nn.Module, group: Any = None) -> int:
    """Sum the gradients of the tagged parameters over ``group``; returns how many were summed.

    Call it after ``loss.backward()`` and before the optimizer step.

    Example:
        >>> import slapo, torch
        >>> model = torch.nn.LayerNorm(4)
        >>> mark_sequence_parallel(model)
        >>> loss = model(torch.randn(2, 4)).sum()
        >>> # in a tensor-parallel job (torchrun): not run here
        >>> mesh = slapo.sharding.init_parallel_mesh("cpu", tp=2)  # doctest: +SKIP
        >>> loss.backward(); allreduce_sequence_parallel_grads(model, group=mesh["tp"])  # doctest: +SKIP
    """
    params = [p for p in model.parameters() if getattr(p, SP_TAG, False) and p.grad is not None]
    if not params:
        return 0
    pg = resolve_group(group)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    _record("bwd", "all_reduce")
    run_collective("all_reduce", pg, lambda: dist.all_reduce(flat, group=pg))
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
    return len(params)
