"""The ``fuse_ops`` and ``fused_loss`` knobs: module swaps that keep every parameter name.

* bias + GELU: the linear layer before a GELU computes ``x @ W`` and hands its bias to one fused
  ``gelu(x + bias)`` kernel (``slapo.op.bias_gelu``); the activation becomes an ``Identity``.
* bias + dropout + residual: a ``dense -> dropout -> LayerNorm(x + residual)`` output block
  (BERT) runs ``slapo.op.BiasDropoutResidual`` between the matmul and the norm.
* fused loss: the LM head is swapped for one that, while the root model computes a loss, hands
  the hidden states through; a hook on the root then computes the loss with
  ``slapo.op.linear_cross_entropy`` in chunks, so the ``tokens x vocab`` logits never exist.
  Outputs then carry ``loss`` and ``logits=None``; without labels the head computes logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..exceptions import SlapoError
from ..op import BiasDropoutResidual, bias_gelu, linear_cross_entropy
from ..schedule import Schedule
from ..surgery import is_conv1d

__all__ = ["LinearBiasGELU", "DenseBiasDropoutResidualNorm", "FusedLossHead", "COMPILER"]

#: The ``torch.compile`` backend of the fused kernels; None runs them eagerly (same numerics).
COMPILER: str | None = "inductor"

# transformers' GELU classes and the torch ``approximate`` mode each one computes.
_GELU_MODES = {
    "GELUActivation": "none",
    "NewGELUActivation": "tanh",
    "GELUTanh": "tanh",
    "PytorchGELUTanh": "tanh",
}

_compiled: dict[tuple[str, str | None], Any] = {}


def _kernel(name: str, fn: Any) -> Any:
    """``fn`` compiled with :data:`COMPILER` once per process (None: ``fn`` itself)."""
    key = (name, COMPILER)
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, backend=COMPILER) if COMPILER else fn
    return _compiled[key]


def gelu_mode(act: nn.Module) -> str | None:
    """The ``approximate`` mode of a GELU module, or None when ``act`` is no GELU."""
    if isinstance(act, nn.GELU):
        return act.approximate
    return _GELU_MODES.get(type(act).__name__)


class LinearBiasGELU(nn.Module):
    """``gelu(x @ W.T + b)`` with the bias add and GELU in one fused kernel.

    Holds the linear layer's own ``weight`` and ``bias`` under the same names.

    Example:
        >>> fused = LinearBiasGELU(nn.Linear(4, 8), approximate="tanh")
        >>> fused(torch.randn(2, 4)).shape
        torch.Size([2, 8])
    """

    def __init__(self, linear: nn.Module, approximate: str = "none") -> None:
        super().__init__()
        if getattr(linear, "bias", None) is None:
            raise SlapoError(f"LinearBiasGELU needs a linear layer with a bias, got {linear}")
        self.weight = linear.weight
        self.bias = linear.bias
        self.transposed = is_conv1d(linear)  # Conv1D stores W as in x out
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.matmul(x, self.weight) if self.transposed else F.linear(x, self.weight)
        return _kernel("bias_gelu", bias_gelu)(out, self.bias, self.approximate)


class DenseBiasDropoutResidualNorm(nn.Module):
    """``LayerNorm(residual + dropout(x @ W.T + b))`` with the middle part fused.

    Replaces a BERT-style output block (children ``dense``, ``dropout``, ``LayerNorm``; called
    as ``block(hidden, residual)``); the children and parameter names stay.

    Example:
        >>> import transformers
        >>> config = transformers.BertConfig(
        ...     hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        ... )
        >>> block = transformers.models.bert.modeling_bert.BertSelfOutput(config)
        >>> fused = DenseBiasDropoutResidualNorm(block)
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.dense = block.dense
        self.dropout = block.dropout
        self.LayerNorm = block.LayerNorm  # noqa: N815  (the name in the checkpoint)
        self.fused = BiasDropoutResidual(p=block.dropout.p, compiler=None)
        self.fused._fn = _kernel("bias_dropout_residual", self.fused._fn)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        self.fused.train(self.dropout.training)
        out = self.fused(F.linear(hidden_states, self.dense.weight), self.dense.bias, input_tensor)
        return self.LayerNorm(out)


def fuse_bias_gelu(sch: Schedule, linear: str, act: str) -> bool:
    """Fuse the bias of ``linear`` with the GELU at ``act``; False when ``act`` is no GELU."""
    mode = gelu_mode(sch[act].mod)
    if mode is None or getattr(sch[linear].mod, "bias", None) is None:
        return False
    sch[linear].replace(LinearBiasGELU(sch[linear].mod, mode))
    sch[act].replace(nn.Identity())
    return True


def fuse_bias_dropout_residual(sch: Schedule, block: str) -> None:
    """Swap a ``dense -> dropout -> LayerNorm(x + residual)`` block for the fused one."""
    sch[block].replace(DenseBiasDropoutResidualNorm(sch[block].mod))


class FusedLossHead(nn.Module):
    """An LM head that passes the hidden states through while its model computes a fused loss.

    It keeps the head's ``weight`` (still tied to the embedding when it was) and ``bias``.

    Example:
        >>> head = FusedLossHead(nn.Linear(8, 32, bias=False))
        >>> head(torch.randn(2, 8)).shape      # not deferring: ordinary logits
        torch.Size([2, 32])
    """

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.weight = head.weight
        self.bias = getattr(head, "bias", None)
        self.deferring = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.deferring else F.linear(hidden, self.weight, self.bias)


def install_fused_loss(sch: Schedule, head: str, shift: bool, chunk_size: int = 1024) -> None:
    """Compute the loss of the root model from the hidden states at ``head`` in chunks.

    ``shift``: next-token prediction (causal LMs compare position t with label t + 1).
    """
    model = sch.mod
    fused = FusedLossHead(sch[head].mod)
    sch[head].replace(fused)
    pending: dict[str, torch.Tensor] = {}

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        labels = kwargs.get("labels")
        if labels is None:
            return None
        if args:
            raise SlapoError("fused_loss: call the model with keyword arguments (input_ids=...)")
        kwargs = dict(kwargs, labels=None)
        if hasattr(module, "_shift_right") and kwargs.get("decoder_input_ids") is None:
            # encoder-decoder models build the decoder inputs from the labels
            kwargs["decoder_input_ids"] = module._shift_right(labels)
        pending["labels"] = labels
        fused.deferring = True
        return args, kwargs

    def post_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        if not fused.deferring:
            return None
        fused.deferring = False
        labels = pending.pop("labels")
        if output is None:  # the forward raised; always_call only resets the head
            return None
        hidden = output.logits
        if shift:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        loss = linear_cross_entropy(
            hidden, fused.weight, labels.to(hidden.device), fused.bias, chunk_size=chunk_size
        )
        # A new output, so that "loss" comes first and "logits" is gone (ModelOutput keys skip
        # None fields; Trainer reads outputs["loss"]).
        rest = {k: v for k, v in output.items() if k not in ("loss", "logits")}
        return type(output)(loss=loss, **rest)

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    model.register_forward_hook(post_hook, with_kwargs=True, always_call=True)
