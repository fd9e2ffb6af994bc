"""Vocabulary-parallel cross-entropy: the loss from logits sharded over the vocabulary.

The embedding side is the shard rule of ``nn.Embedding`` (``shard("weight", axis=0)``, see
``rules.py``); a tied LM head then produces this rank's slice of the logits, and this loss consumes
it without ever gathering the full ``[tokens, vocab]`` tensor: one max and two sums are reduced
over the group. Columns past ``vocab_size`` (padding added by ``shard(..., pad=True)``) are
excluded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..exceptions import SlapoError
from .collectives import _record, run_collective
from .groups import resolve_group

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any, vocab_size: int
    ) -> torch.Tensor:
        rank, local = dist.get_rank(group), logits.shape[-1]
        start = rank * local
        logits = logits.float()
        valid_cols = vocab_size - start  # columns of this shard that are real vocabulary
        if valid_cols < local:
            logits = logits.clone()
            logits[..., max(valid_cols, 0) :] = float("-inf")
        row_max = logits.max(dim=-1).values
        _record("fwd", "all_reduce")
        run_collective(
            "all_reduce", group, lambda: dist.all_reduce(row_max, dist.ReduceOp.MAX, group=group)
        )
        shifted = logits - row_max.unsqueeze(-1)

        inside = (target >= start) & (target < start + local)
        local_target = (target - start).masked_fill(~inside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        picked = picked.masked_fill(~inside, 0.0)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), picked])
        _record("fwd", "all_reduce")
        run_collective("all_reduce", group, lambda: dist.all_reduce(sums, group=group))
        sum_exp, target_logit = sums[0], sums[1]
        loss = sum_exp.log() - target_logit

        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, inside, local_target)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, inside, local_target = ctx.saved_tensors
        grad_logits = softmax.clone()
        flat = grad_logits.view(-1, grad_logits.shape[-1])
        rows = torch.arange(flat.shape[0], device=flat.device)
        flat[rows, local_target.view(-1)] -= inside.view(-1).to(flat.dtype)
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Any = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``target`` under logits sharded over the last (vocabulary) dimension.

    Args:
        logits: ``[..., vocab_local]``, this rank's contiguous slice of the vocabulary.
        target: ``[...]`` global token ids; ``ignore_index`` entries count for nothing.
        group: the tensor-parallel group (a ProcessGroup, 1-D DeviceMesh or None).
        vocab_size: the real vocabulary size when it was padded; padded columns are ignored.
        reduction: ``"mean"`` (over non-ignored targets), ``"sum"`` or ``"none"``.

    Example (each of 2 ranks holds 48 of 96 logits):
        >>> local_logits = torch.randn(4, 48, requires_grad=True)  # this rank's half of the logits
        >>> labels = torch.randint(0, 96, (4,))
        >>> loss = vocab_parallel_cross_entropy(local_logits, labels, group=None, vocab_size=96)  # doctest: +SKIP
    """
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    vocab_size = vocab_size if vocab_size is not None else logits.shape[-1] * world
    if vocab_size > logits.shape[-1] * world:
        raise SlapoError(
            f"vocab_parallel_cross_entropy: vocab_size {vocab_size} exceeds the {world} x "
            f"{logits.shape[-1]} logits columns of the group"
        )
    if target.shape != logits.shape[:-1]:
        raise SlapoError(
            f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} does not match "
            f"logits shape {tuple(logits.shape)} without the last dimension"
        )
    keep = target != ignore_index
    loss = _VocabParallelCE.apply(logits, target.masked_fill(~keep, 0), pg, vocab_size)
    loss = loss * keep
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / keep.sum().clamp(min=1)
    raise SlapoError(f"vocab_parallel_cross_entropy: unknown reduction {reduction!r}")
