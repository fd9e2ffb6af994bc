"""RoundPipe preset for GPT-2: token + position embedding | one layer per block | ln_f + head.

The LM head shares its weight with the token embedding: both layers get a device copy
and their gradients are summed on the host.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .decoder import DecoderHead

MODEL_CLASSES = ("GPT2LMHeadModel",)


class GPT2Embed(nn.Module):
    """Token + position embeddings and embedding dropout."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **unused: Any) -> tuple:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        hidden = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        hidden = self.drop(hidden + self.wpe(position_ids))
        return hidden, attention_mask, position_ids, labels


class GPT2BlockLayer(nn.Module):
    """One GPT-2 block with its causal mask built locally."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block = block
        self.config = config

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor, labels: torch.Tensor | None) -> tuple:
        from transformers.masking_utils import create_causal_mask

        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  past_key_values=None, position_ids=position_ids)
        out = self.block(hidden, attention_mask=mask)
        hidden = out[0] if isinstance(out, tuple) else out
        return hidden, attention_mask, position_ids, labels


def wrap(model: nn.Module, **roundpipe_kwargs: Any) -> Any:
    """Wrap a ``GPT2LMHeadModel``; call it like the original (``input_ids``, ``labels``, ...)."""
    from ..roundpipe import RoundPipe

    t = model.transformer
    layers = [GPT2Embed(t.wte, t.wpe, t.drop), *[GPT2BlockLayer(b, model.config) for b in t.h],
              DecoderHead(t.ln_f, model.lm_head, model)]
    return RoundPipe(model, layers=layers, **roundpipe_kwargs)
