"""RoundPipe preset for GPT-2: token + position embedding | one layer per block | ln_f + head.

The LM head shares its weight with the token embedding: both layers get a device copy
and their gradients are summed on the host.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .causal_lm import CausalLMRoundPipe
from .decoder import DecoderEmbed, DecoderHead, causal_mask
from .kernels import call_gpt2_block, prefer_sdpa

MODEL_CLASSES = ("GPT2LMHeadModel",)


class GPT2Embed(DecoderEmbed):
    """Token + position embeddings and embedding dropout."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__(wte)
        self.wpe, self.drop = wpe, drop

    def add_positions(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Add learned position embeddings, then embedding dropout."""
        return self.drop(hidden + self.wpe(position_ids))


class GPT2BlockLayer(nn.Module):
    """One GPT-2 block with its causal mask built locally."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block = block
        self.config = config

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        extras: dict[str, Any],
    ) -> tuple:
        mask = causal_mask(self.config, hidden, attention_mask, position_ids)
        out = call_gpt2_block(self.block, hidden, mask)
        hidden = out[0] if isinstance(out, tuple) else out
        return hidden, attention_mask, position_ids, extras


def wrap(
    model: nn.Module, root: nn.Module | None = None, **roundpipe_kwargs: Any
) -> CausalLMRoundPipe:
    """Wrap a ``GPT2LMHeadModel``; call it like the original (``input_ids``, ``labels``, ...).

    ``root`` is the module the RoundPipe model stands for when it is not ``model`` itself
    (a PEFT model around it); the layers always come from ``model``.
    """
    prefer_sdpa(model)
    t = model.transformer
    layers = [
        GPT2Embed(t.wte, t.wpe, t.drop),
        *[GPT2BlockLayer(b, model.config) for b in t.h],
        DecoderHead(t.ln_f, model.lm_head),
    ]
    return CausalLMRoundPipe(model if root is None else root, layers=layers, **roundpipe_kwargs)
