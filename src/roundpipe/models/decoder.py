"""Layers shared by decoder-only presets (Llama, Qwen3): embedding, block, head.

Between layers flows the tuple ``(hidden_states, attention_mask, position_ids, labels)``;
each block rebuilds its causal mask and rotary embeddings locally, which is cheaper than
shipping them through host memory.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

# Keywords PeftModel.forward handles itself (per-sample adapters) before calling the model.
_PEFT_FORWARD_ARGS = frozenset({"adapter_names", "alora_offsets"})


def causal_mask(
    config: Any,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    sliding: bool = False,
) -> Any:
    """The (sliding-window) causal mask a Hugging Face decoder layer expects."""
    # deferred: transformers is heavy and only Hugging Face models reach this layer
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
    return make_mask(
        config=config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **{_mask_cache_arg(make_mask): None},
    )


@functools.cache
def _mask_cache_arg(make_mask: Any) -> str:
    """The name of the mask builder's cache argument: ``past_key_values`` up to transformers
    5.23, ``cache`` from 5.24 (the old name warns there and goes in 5.40)."""
    params = inspect.signature(make_mask).parameters
    return "cache" if "cache" in params else "past_key_values"


class DecoderEmbed(nn.Module):
    """Token embedding; also fills default position ids.

    Subclasses add position embeddings by overriding :meth:`add_positions`.
    """

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def add_positions(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Combine token embeddings with positions (rotary models: nothing to add here)."""
        return hidden

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **unused: Any,
    ) -> tuple:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        peft_args = sorted(_PEFT_FORWARD_ARGS.intersection(unused))
        if peft_args:  # PeftModel.forward would route them to hooks the preset layers bypass
            raise NotImplementedError(
                f"RoundPipe's preset runs the PEFT model's layers directly and cannot honour "
                f"{peft_args}: call it without them (one active adapter for the whole batch)"
            )
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        return self.add_positions(hidden, position_ids), attention_mask, position_ids, labels


class DecoderBlock(nn.Module):
    """One transformer block with its own mask and rotary embedding computation."""

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: Any, sliding: bool) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.config = config
        self.sliding = sliding

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        labels: torch.Tensor | None,
    ) -> tuple:
        mask = causal_mask(self.config, hidden, attention_mask, position_ids, self.sliding)
        pe = self.rotary_emb(hidden, position_ids)
        hidden = self.layer(
            hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=pe
        )
        return hidden, attention_mask, position_ids, labels


class DecoderHead(nn.Module):
    """Final norm + LM head, and the loss when labels are given."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, owner: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.vocab_size = owner.config.vocab_size
        object.__setattr__(self, "_loss", owner.loss_function)  # not a submodule

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        labels: torch.Tensor | None,
    ) -> Any:
        # deferred: transformers is heavy and only Hugging Face models reach this layer
        from transformers.modeling_outputs import CausalLMOutputWithPast

        logits = self.lm_head(self.norm(hidden))
        loss = None if labels is None else self._loss(logits, labels, vocab_size=self.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Layer list of a Llama-style ``*ForCausalLM``."""
    base = model.model
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * len(base.layers)
    blocks = [
        DecoderBlock(layer, base.rotary_emb, model.config, types[i] == "sliding_attention")
        for i, layer in enumerate(base.layers)
    ]
    return [DecoderEmbed(base.embed_tokens), *blocks, DecoderHead(base.norm, model.lm_head, model)]
