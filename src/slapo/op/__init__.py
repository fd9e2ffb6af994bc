"""Ready modules for the common replacements in scheduled models.

Example:
    >>> import torch
    >>> from slapo import op
    >>> act = op.FusedBiasGELU(16)
    >>> y = act(torch.randn(2, 16))
"""

from .attention import (
    ATTENTION_IMPLS,
    FlashAttentionOp,
    SDPAttention,
    attention,
    register_transformers_attention,
)
from .cross_entropy import LinearCrossEntropy, linear_cross_entropy
from .linear import FusedQKV
from .mlp import MLP_ACTIVATIONS, BiasDropoutResidual, FusedBiasGELU, FusedMLP, bias_gelu
from .print import Print

__all__ = [
    "ATTENTION_IMPLS",
    "BiasDropoutResidual",
    "FlashAttentionOp",
    "FusedBiasGELU",
    "FusedMLP",
    "FusedQKV",
    "LinearCrossEntropy",
    "MLP_ACTIVATIONS",
    "Print",
    "SDPAttention",
    "attention",
    "bias_gelu",
    "linear_cross_entropy",
    "register_transformers_attention",
]
