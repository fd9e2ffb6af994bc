"""Chunked, fused LM head + cross-entropy for the presets' last stage.

A causal LM's head turns ``tokens x hidden`` states into ``tokens x vocab`` logits; at long
sequences those logits (and their gradient) dwarf everything else on the device. Here the
head and the loss run over chunks of tokens: each chunk's logits are made, reduced to its
token losses and (when gradients are wanted) to its gradients for the hidden states and the
head's weight, then freed. Peak extra memory is ``chunk_size x vocab``.

Token losses are SUMMED; the caller divides by the number of target tokens it normalises over
(``num_items_in_batch``, as transformers does), so the loss of a microbatch is its share of
the whole batch's loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import RoundPipeValueError

__all__ = ["DEFAULT_CHUNK_SIZE", "linear_cross_entropy_sum", "shift_targets"]

#: Tokens per chunk: 4096 x a 152 K vocabulary is 2.3 GiB of fp32 logits, the largest piece.
DEFAULT_CHUNK_SIZE = 4096


def shift_targets(
    labels: torch.Tensor | None, shift_labels: torch.Tensor | None, ignore_index: int
) -> torch.Tensor:
    """Next-token targets, flattened: ``labels`` shifted left by one (the last position of each
    row is ignored), or ``shift_labels`` as given, exactly as transformers' causal-LM loss.

    Example:
        >>> shift_targets(torch.tensor([[1, 2, 3]]), None, -100).tolist()
        [2, 3, -100]
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def _chunk_rows(targets: torch.Tensor, ignore_index: int, chunk_size: int) -> list[torch.Tensor]:
    """Indices of the target rows, in chunks; ignored rows cost nothing."""
    rows = (targets != ignore_index).nonzero().squeeze(1)
    return list(rows.split(chunk_size)) if rows.numel() else []


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # fp32 like transformers' loss, which upcasts the head's output
    return F.linear(x, weight, bias).float()


class _LinearCrossEntropySum(torch.autograd.Function):
    """Sum of token cross-entropies of ``x @ weight.T + bias``; gradients made in forward.

    The gradients are computed while each chunk's logits exist (one matmul for the logits,
    two for the gradients: what an unfused head costs) and scaled by the incoming gradient
    in backward, which is a scalar.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunks: list[torch.Tensor],
    ) -> torch.Tensor:
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = torch.zeros_like(x) if need_x else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for rows in chunks:
            xc, tc = x.index_select(0, rows), targets.index_select(0, rows)
            logits = _chunk_logits(xc, weight, bias)
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
            # d(sum of losses) / d logits = softmax - one_hot(target)
            g = logits.sub_(lse[:, None]).exp_()
            g[torch.arange(g.shape[0], device=g.device), tc] -= 1.0
            if grad_x is not None:
                grad_x.index_copy_(0, rows, (g.to(weight.dtype) @ weight).to(x.dtype))
            if grad_w is not None:
                grad_w.addmm_(g.t(), xc.float())
            if grad_b is not None:
                grad_b += g.sum(0)
        ctx.save_for_backward(grad_x, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        grad_x, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        gx = None if grad_x is None else grad_x * grad_out.to(grad_x.dtype)
        gw = None if grad_w is None else (grad_w * grad_out).to(w_dtype)
        gb = None if grad_b is None else (grad_b * grad_out).to(b_dtype)
        return gx, gw, gb, None, None


def _plain_linear(head: nn.Module) -> bool:
    """Whether ``head`` computes exactly ``F.linear(x, weight, bias)`` (no adapter, no hook)."""
    return (
        isinstance(head, nn.Linear)
        and not head._forward_hooks
        and not head._forward_pre_hooks
        and type(head).forward is nn.Linear.forward
    )


def _no_grad_sum(
    head: nn.Module, x: torch.Tensor, targets: torch.Tensor, chunks: list[torch.Tensor]
) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for rows in chunks:
        logits = head(x.index_select(0, rows)).float()
        total += F.cross_entropy(logits, targets.index_select(0, rows), reduction="sum")
    return total


def _chunk_loss(head: nn.Module, xc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(xc).float(), tc, reduction="sum")


def _checkpointed_sum(
    head: nn.Module, x: torch.Tensor, targets: torch.Tensor, chunks: list[torch.Tensor]
) -> torch.Tensor:
    """Any head (e.g. a LoRA-wrapped one): each chunk's logits are recomputed in backward."""
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for rows in chunks:
        xc, tc = x.index_select(0, rows), targets.index_select(0, rows)
        total = total + checkpoint(_chunk_loss, head, xc, tc, use_reentrant=False)
    return total


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """``cross_entropy(head(hidden), targets, reduction="sum")`` over chunks of tokens, without
    the full logits; ``targets`` equal to ``ignore_index`` are skipped.

    A plain ``nn.Linear`` head uses a fused kernel (its gradients made chunk by chunk in
    forward); any other head (an adapter around it) is checkpointed chunk by chunk.

    Example:
        >>> head = nn.Linear(8, 32, bias=False)
        >>> h = torch.randn(2, 5, 8, requires_grad=True)
        >>> t = torch.randint(0, 32, (10,))
        >>> loss = linear_cross_entropy_sum(h, head, t, chunk_size=4)
        >>> ref = F.cross_entropy(head(h).reshape(10, 32), t, reduction="sum")
        >>> torch.allclose(loss, ref, atol=1e-5)
        True
    """
    if chunk_size < 1:
        raise RoundPipeValueError(f"chunk_size must be positive, got {chunk_size}")
    x = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(x.device)
    if targets.shape[0] != x.shape[0]:
        raise RoundPipeValueError(f"{targets.shape[0]} targets for {x.shape[0]} hidden states")
    chunks = _chunk_rows(targets, ignore_index, chunk_size)
    params = [p for p in head.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        with torch.no_grad():
            return _no_grad_sum(head, x, targets, chunks)
    if _plain_linear(head):
        return _LinearCrossEntropySum.apply(x, head.weight, head.bias, targets, chunks)
    return _checkpointed_sum(head, x, targets, chunks)
