"""Fused elementwise tails of MLP and residual blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["bias_gelu", "FusedBiasGELU", "BiasDropoutResidual"]


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)``; compiled by :class:`FusedBiasGELU` into one kernel."""
    return F.gelu(x + bias, approximate=approximate)


class FusedBiasGELU(nn.Module):
    """``gelu(x + bias)`` with the bias owned here, compiled (inductor) into one kernel.

    Pair it with ``decompose()``: the linear layer computes ``x @ W.T`` only and this module
    adds the bias and applies GELU in one pass over memory.

    Example:
        >>> act = FusedBiasGELU(8, compiler=None)
        >>> act(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(
        self,
        size: int | None = None,
        approximate: str = "none",
        compiler: str | None = "inductor",
        bias: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        if bias is None:
            if size is None:
                raise ValueError("FusedBiasGELU needs a size or a bias")
            bias = nn.Parameter(torch.zeros(size))
        self.bias = bias
        self.approximate = approximate
        self._fn = torch.compile(bias_gelu, backend=compiler) if compiler else bias_gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x, self.bias, self.approximate)


def _bias_dropout_residual(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p, training)


class BiasDropoutResidual(nn.Module):
    """``residual + dropout(x + bias)``, dropout following ``train()``/``eval()``.

    Example:
        >>> block = BiasDropoutResidual(p=0.1, compiler=None)
        >>> block(torch.randn(2, 8), torch.zeros(8), torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, p: float = 0.1, compiler: str | None = "inductor") -> None:
        super().__init__()
        self.p = p
        fn = _bias_dropout_residual
        self._fn = torch.compile(fn, backend=compiler) if compiler else fn

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
    ) -> torch.Tensor:
        return self._fn(x, bias, residual, self.p, self.training)
