"""Fused elementwise tails of MLP and residual blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["bias_gelu", "FusedBiasGELU", "BiasDropoutResidual", "FusedMLP", "MLP_ACTIVATIONS"]


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


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The activations of FusedMLP, by the names transformers configs use.
MLP_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_tanh": _gelu_tanh,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def _bias_act(x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    return MLP_ACTIVATIONS[activation](x if bias is None else x + bias)


class FusedMLP(nn.Module):
    """``dropout(fc_out(act(fc_in(x))))``, the bias add and activation compiled into one kernel.

    ``fc_in`` and ``fc_out`` are plain ``nn.Linear`` layers (shardable, and their state dict is
    that of a two-Linear MLP); ``fc_in``'s matmul runs alone and its bias joins the activation.
    ``activation``: a name of :data:`MLP_ACTIVATIONS`; ``dropout`` follows ``train()``/``eval()``.

    Example:
        >>> mlp = FusedMLP(8, 32, activation="gelu_new", compiler=None)
        >>> mlp(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "gelu",
        bias: bool = True,
        dropout: float = 0.0,
        compiler: str | None = "inductor",
    ) -> None:
        super().__init__()
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(
                f"FusedMLP activation must be one of {sorted(MLP_ACTIVATIONS)}, got {activation!r}"
            )
        self.fc_in = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.fc_out = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = activation
        self.dropout = nn.Dropout(dropout)
        self._fn = torch.compile(_bias_act, backend=compiler) if compiler else _bias_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._fn(F.linear(x, self.fc_in.weight), self.fc_in.bias, self.activation)
        return self.dropout(self.fc_out(h))
