"""Fused elementwise tails of MLP and residual blocks."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..exceptions import OpError, SlapoError

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
                raise OpError("FusedBiasGELU needs a size or a bias")
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


# The activations of FusedMLP, by the names transformers configs use, and the one computation
# each stands for (a string, so that TorchScript can script the fused function too).
_ACTIVATION_KINDS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def _activate(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "relu":
        return F.relu(x)
    if kind == "silu":
        return F.silu(x)
    return F.gelu(x)


#: The activations of :class:`FusedMLP`, by name: ``MLP_ACTIVATIONS["gelu_new"](x)``.
MLP_ACTIVATIONS = {name: partial(_activate, kind=kind) for name, kind in _ACTIVATION_KINDS.items()}


def _bias_act(x: torch.Tensor, bias: torch.Tensor | None, kind: str) -> torch.Tensor:
    if bias is not None:
        x = x + bias
    return _activate(x, kind)


_COMPILER_UNSET: Any = object()


@cache
def _fused_bias_act(compiler: str | None) -> Callable[..., torch.Tensor]:
    """``_bias_act`` as ``compiler`` makes it: None eager, ``"TorchScript"`` scripted, any other
    name a ``torch.compile`` backend (compiled on the first call). One per compiler, shared by
    every module (and held outside them: a scripted function cannot be deep-copied)."""
    if compiler is None:
        return _bias_act
    if isinstance(compiler, str) and compiler.lower() == "torchscript":
        script = getattr(torch.jit, "script", None)
        if script is None:
            raise SlapoError("FusedMLP: this torch has no TorchScript; use compiler='inductor'")
        return script(_bias_act)
    return torch.compile(_bias_act, backend=compiler)


class FusedMLP(nn.Module):
    """``dropout(fc_out(act(fc_in(x))))``, the bias add and activation fused into one kernel.

    The constructor takes Slapo's arguments: ``FusedMLP(hidden_size, intermediate_size,
    orig_act, resid_pdrop, use_torchscript=False)``. ``orig_act`` (or ``activation=``) is a name
    of :data:`MLP_ACTIVATIONS`; ``resid_pdrop`` (or ``dropout=``) is the probability of the
    dropout on the output, which follows ``train()``/``eval()``. ``use_torchscript=True`` fuses
    with TorchScript; otherwise ``compiler`` names the fusion: a ``torch.compile`` backend
    (default ``"inductor"``), ``"TorchScript"``, or None for eager.

    ``fc_in`` and ``fc_out`` are plain ``nn.Linear`` layers (shardable, and their state dict is
    that of a two-Linear MLP); ``fc_in``'s matmul runs alone and its bias joins the activation.

    Example:
        >>> mlp = FusedMLP(8, 32, "gelu_new", 0.1, use_torchscript=True)
        >>> mlp(torch.randn(2, 8)).shape
        torch.Size([2, 8])
        >>> FusedMLP(8, 32, activation="relu", bias=False, compiler=None).fc_in.bias is None
        True
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        orig_act: str | None = None,
        resid_pdrop: float | None = None,
        use_torchscript: bool = False,
        *,
        activation: str | None = None,
        bias: bool = True,
        dropout: float | None = None,
        compiler: str | None = _COMPILER_UNSET,
    ) -> None:
        super().__init__()
        activation = _one_of("orig_act", orig_act, "activation", activation, "gelu")
        dropout = _one_of("resid_pdrop", resid_pdrop, "dropout", dropout, 0.0)
        if activation not in MLP_ACTIVATIONS:
            raise SlapoError(
                f"FusedMLP activation must be one of {sorted(MLP_ACTIVATIONS)}, got {activation!r}"
            )
        if isinstance(dropout, bool) or not isinstance(dropout, int | float):
            raise SlapoError(
                f"FusedMLP resid_pdrop (dropout) must be a probability, got {dropout!r}; the "
                "arguments are (hidden_size, intermediate_size, orig_act, resid_pdrop, "
                "use_torchscript), and bias= is a keyword"
            )
        if use_torchscript:
            if compiler not in (_COMPILER_UNSET, "TorchScript", "torchscript"):
                raise SlapoError(
                    f"FusedMLP: use_torchscript=True and compiler={compiler!r} disagree; pass one"
                )
            compiler = "TorchScript"
        elif compiler is _COMPILER_UNSET:
            compiler = "inductor"
        self.fc_in = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.fc_out = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = activation
        self.dropout = nn.Dropout(float(dropout))
        self.compiler = compiler
        _fused_bias_act(compiler)  # compile (TorchScript) now: a failure shows here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = _fused_bias_act(self.compiler)
        h = fn(F.linear(x, self.fc_in.weight), self.fc_in.bias, _ACTIVATION_KINDS[self.activation])
        return self.dropout(self.fc_out(h))


def _one_of(name: str, value: Any, alias: str, alias_value: Any, default: Any) -> Any:
    """The value of an argument that has two names (Slapo's and ours); both given is an error."""
    if value is not None and alias_value is not None:
        raise SlapoError(
            f"FusedMLP got both {name}={value!r} and {alias}={alias_value!r}; pass one"
        )
    if value is not None:
        return value
    return default if alias_value is None else alias_value
