"""Chunked fused linear + cross-entropy: the full ``(tokens, vocab)`` logits never exist.

The loss head of a language model materializes ``tokens x vocab`` logits (and as much again
for their gradient). Here the rows are processed in chunks: each chunk's logits are computed,
turned into its loss and its gradients with respect to the hidden states and the weight, and
freed. Peak extra memory is ``chunk_size x vocab`` instead of ``tokens x vocab``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..exceptions import OpError

__all__ = ["linear_cross_entropy", "LinearCrossEntropy"]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        ignore_index: int,
        chunk_size: int,
        reduction: str,
    ) -> torch.Tensor:
        valid = labels != ignore_index
        denom = valid.sum().clamp(min=1).to(torch.float32) if reduction == "mean" else 1.0
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = torch.zeros_like(x) if need_x else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = (
            torch.zeros_like(bias, dtype=torch.float32) if need_b and bias is not None else None
        )
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, x.shape[0], chunk_size):
            xc = x[start : start + chunk_size]
            yc = labels[start : start + chunk_size]
            vc = valid[start : start + chunk_size]
            logits = xc @ weight.t()
            if bias is not None:
                logits = logits + bias
            logits = logits.float()
            lse = torch.logsumexp(logits, dim=-1)
            target = torch.where(vc, yc, 0)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            total += ((lse - picked) * vc).sum()
            if not (need_x or need_w or need_b):
                continue
            # d loss / d logits = softmax - one_hot, on valid rows, divided by the token count.
            grad = logits.sub_(lse[:, None]).exp_()
            grad[torch.arange(grad.shape[0], device=grad.device), target] -= 1.0
            grad *= (vc.to(grad.dtype) / denom)[:, None]
            if grad_x is not None:
                grad_x[start : start + chunk_size] = (grad.to(weight.dtype) @ weight).to(x.dtype)
            if grad_w is not None:
                grad_w += grad.t() @ xc.float()
            if grad_b is not None:
                grad_b += grad.sum(0)
        ctx.save_for_backward(grad_x, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total / denom

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        grad_x, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        gx = grad_x * grad_out if grad_x is not None else None
        gw = (grad_w * grad_out).to(w_dtype) if grad_w is not None else None
        gb = (grad_b * grad_out).to(b_dtype) if grad_b is not None else None
        return gx, gw, gb, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int = 1024,
    reduction: str = "mean",
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, labels)`` without the full logits.

    Example:
        >>> h, w = torch.randn(6, 8, requires_grad=True), torch.randn(32, 8)
        >>> loss = linear_cross_entropy(h, w, torch.randint(0, 32, (6,)), chunk_size=4)
        >>> loss.backward()
    """
    if reduction not in ("mean", "sum"):
        raise OpError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    x = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    return _LinearCrossEntropy.apply(x, weight, bias, y, ignore_index, chunk_size, reduction)


class LinearCrossEntropy(nn.Module):
    """The LM head and its loss in one: ``forward(hidden, labels) -> loss``.

    It reuses the head's own parameters (tied embeddings stay tied). Labels are used as given:
    shift them before the call for next-token prediction.

    Example:
        >>> head = nn.Linear(8, 32, bias=False)
        >>> loss_fn = LinearCrossEntropy(head, chunk_size=4)
        >>> loss = loss_fn(torch.randn(2, 3, 8), torch.randint(0, 32, (2, 3)))
    """

    def __init__(self, head: nn.Linear, chunk_size: int = 1024, ignore_index: int = -100) -> None:
        super().__init__()
        self.head = head
        self.chunk_size = chunk_size
        self.ignore_index = ignore_index

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(
            hidden, self.head.weight, labels, self.head.bias, self.ignore_index, self.chunk_size
        )
