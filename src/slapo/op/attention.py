"""Scaled-dot-product attention: eager, SDPA, and flash kernels on CUDA.

:func:`register_transformers_attention` plugs it into any transformers family through
``AttentionInterface``, so ``model.set_attn_implementation("slapo")`` (or
``config._attn_implementation = "slapo"``) switches every attention layer at once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..exceptions import SlapoError

__all__ = [
    "ATTENTION_IMPLS",
    "attention",
    "FlashAttentionOp",
    "SDPAttention",
    "register_transformers_attention",
]

ATTENTION_IMPLS = ("auto", "eager", "sdpa", "flash")

# Slapo's kernel names for FlashAttentionOp: its flash kernels (xformers', triton's, the CUDA
# package's) are all served by torch's flash backend where it applies, else by SDPA ("auto").
_SLAPO_ATTENTION_OPS = {
    "cuda": "auto",
    "triton": "auto",
    "native_flash": "auto",
    "native_xformers": "auto",
    "flash_attn": "auto",
}


def _eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        lq, lk = q.shape[-2], k.shape[-2]
        causal = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        )
    probs = F.dropout(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), dropout_p)
    return torch.matmul(probs, v)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Attention over ``(batch, heads, seq, head_dim)`` tensors; K/V heads may be fewer (GQA).

    ``impl``: ``"eager"`` (matmul + softmax), ``"sdpa"`` (torch's fused kernel), ``"flash"``
    (flash-attention kernel, CUDA half precision only) or ``"auto"`` (flash where it applies,
    else SDPA).

    Example:
        >>> q = k = v = torch.randn(2, 4, 8, 16)
        >>> attention(q, k, v, is_causal=True).shape
        torch.Size([2, 4, 8, 16])
    """
    if impl not in ATTENTION_IMPLS:
        raise SlapoError(f"attention impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if k.shape[1] != q.shape[1]:  # grouped-query attention: repeat the K/V heads
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    flash_ok = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and mask is None
    if impl == "flash" and not flash_ok:
        raise SlapoError(
            "flash attention needs CUDA fp16/bf16 tensors and no explicit mask; use impl='sdpa'"
        )
    if impl == "eager":
        return _eager(q, k, v, mask, dropout_p, is_causal, scale)
    if impl == "flash" or (impl == "auto" and flash_ok):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale
            )
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=is_causal and mask is None,
        scale=scale,
    )


class SDPAttention(nn.Module):
    """Attention core as a module: ``forward(q, k, v, mask=None)``; dropout follows the mode.

    Example:
        >>> attn = SDPAttention(dropout=0.1, is_causal=True, impl="sdpa")
        >>> attn(*[torch.randn(1, 2, 4, 8)] * 3).shape
        torch.Size([1, 2, 4, 8])
    """

    def __init__(self, dropout: float = 0.0, is_causal: bool = False, impl: str = "auto") -> None:
        super().__init__()
        self.dropout = dropout
        self.is_causal = is_causal
        self.impl = impl

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return attention(q, k, v, mask, p, self.is_causal, impl=self.impl)


class FlashAttentionOp(nn.Module):
    """Slapo's attention op: FlashAttention where the GPU runs it (CUDA, fp16/bf16, no explicit
    mask), else torch SDPA; the module form of :func:`attention`.

    ``forward(query, key, value, attention_mask=None, p=0.0)`` over ``(batch, heads, seq,
    head_dim)`` tensors; ``p`` (dropout) applies in training mode only. ``attn_op_name``: one of
    :data:`ATTENTION_IMPLS` or a Slapo kernel name (``"cuda"``, ``"triton"``, ``"native_flash"``,
    ``"native_xformers"``: all ``"auto"`` here). ``apply_causal_mask`` masks future positions.

    Example:
        >>> op = FlashAttentionOp("cuda", apply_causal_mask=True)
        >>> op(*[torch.randn(1, 2, 4, 8)] * 3).shape
        torch.Size([1, 2, 4, 8])
    """

    def __init__(
        self,
        attn_op_name: str = "auto",
        apply_causal_mask: bool = False,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        impl = _SLAPO_ATTENTION_OPS.get(attn_op_name, attn_op_name)
        if impl not in ATTENTION_IMPLS:
            known = (*ATTENTION_IMPLS, *_SLAPO_ATTENTION_OPS)
            raise SlapoError(f"attn_op_name must be one of {known}, got {attn_op_name!r}")
        self.impl = impl
        self.apply_causal_mask = apply_causal_mask
        self.scale = scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        p: float = 0.0,
    ) -> torch.Tensor:
        p = p if self.training else 0.0
        return attention(
            query, key, value, attention_mask, p, self.apply_causal_mask, self.scale, self.impl
        )


def _transformers_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    mask = attention_mask
    if mask is not None and mask.dim() == 4:
        mask = mask[:, :, :, : key.shape[-2]]
    impl = getattr(module, "slapo_attention_impl", "auto")
    out = attention(query, key, value, mask, dropout, bool(causal and mask is None), scaling, impl)
    return out.transpose(1, 2).contiguous(), None


def register_transformers_attention(name: str = "slapo") -> str:
    """Register Slapo's attention with transformers under ``name`` and return the name.

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(
        ...     num_hidden_layers=2, hidden_size=16, intermediate_size=32,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
        ... )
        >>> model = transformers.LlamaForCausalLM(config)
        >>> name = register_transformers_attention()
        >>> model.set_attn_implementation(name)
    """
    from transformers import AttentionInterface  # deferred: transformers takes seconds to import

    AttentionInterface.register(name, _transformers_attention)
    return name
