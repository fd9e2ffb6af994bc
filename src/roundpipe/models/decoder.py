"""Layers shared by decoder-only presets (Llama, Qwen3, Qwen3-MoE, GPT-2): embedding, block, head.

Between layers flows the tuple ``(hidden_states, attention_mask, position_ids, extras)``;
each block rebuilds its causal mask and rotary embeddings locally, which is cheaper than
shipping them through host memory. ``extras`` is a dict of what only the head (or the MoE
blocks) read: the labels and the loss options, and the router statistics of MoE models.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import RoundPipeValueError
from .kernels import call_decoder_layer, prefer_sdpa
from .loss import DEFAULT_CHUNK_SIZE, linear_cross_entropy_sum, shift_targets

# Keywords PeftModel.forward handles itself (per-sample adapters) before calling the model.
_PEFT_FORWARD_ARGS = frozenset({"adapter_names", "alora_offsets"})
# Keywords of a causal LM's forward that reach its loss (or, for MoE, its router loss).
LOSS_ARGS = (
    "labels",
    "shift_labels",
    "num_items_in_batch",
    "ignore_index",
    "return_logits",
    "output_router_logits",
)


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
    """Token embedding; also fills default position ids and gathers the loss options.

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
        **kwargs: Any,
    ) -> tuple:
        if (input_ids is None) == (inputs_embeds is None):
            raise RoundPipeValueError("pass exactly one of input_ids or inputs_embeds")
        peft_args = sorted(_PEFT_FORWARD_ARGS.intersection(kwargs))
        if peft_args:  # PeftModel.forward would route them to hooks the preset layers bypass
            raise NotImplementedError(
                f"RoundPipe's preset runs the PEFT model's layers directly and cannot honour "
                f"{peft_args}: call it without them (one active adapter for the whole batch)"
            )
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        extras = {k: kwargs.get(k) for k in LOSS_ARGS[1:]}
        extras["labels"] = labels
        return self.add_positions(hidden, position_ids), attention_mask, position_ids, extras


class DecoderBlock(nn.Module):
    """One transformer block with its own mask and rotary embedding computation.

    The Hugging Face layer runs through ``torch.compile`` when the presets compile (see
    :mod:`roundpipe.models.kernels`) and ``compile_layer`` is True.
    """

    compile_layer = True

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: Any, sliding: bool) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.config = config
        self.sliding = sliding

    def run_layer(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """The wrapped Hugging Face decoder layer on one microbatch."""
        mask = causal_mask(self.config, hidden, attention_mask, position_ids, self.sliding)
        pe = self.rotary_emb(hidden, position_ids)
        return call_decoder_layer(self.layer, hidden, mask, position_ids, pe, self.compile_layer)

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        extras: dict[str, Any],
    ) -> tuple:
        hidden = self.run_layer(hidden, attention_mask, position_ids)
        return hidden, attention_mask, position_ids, extras


def _token_loss_sum(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    ignore_index: int,
    return_logits: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(sum of the token losses, the logits when asked for them)."""
    if not return_logits:
        return linear_cross_entropy_sum(hidden, head, targets, ignore_index, chunk_size), None
    logits = head(hidden)
    flat = logits.float().reshape(-1, logits.shape[-1])
    loss = F.cross_entropy(
        flat, targets.to(flat.device), ignore_index=ignore_index, reduction="sum"
    )
    return loss, logits


class DecoderHead(nn.Module):
    """Final norm + LM head, and the loss when labels are given.

    The loss is the sum of the token losses divided by ``num_items_in_batch`` (the RoundPipe
    preset model fills it with the target count of the whole batch when the caller does not,
    so the microbatch losses add up to the batch's mean). With ``return_logits=False`` the
    logits are never materialised: head and loss run over chunks of ``chunk_size`` tokens.
    """

    def __init__(
        self, norm: nn.Module, lm_head: nn.Module, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.chunk_size = chunk_size

    def loss_and_logits(
        self, hidden: torch.Tensor, extras: dict[str, Any]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(loss or None without labels, logits or None with ``return_logits=False``)."""
        hidden = self.norm(hidden)
        labels, shift_labels = extras.get("labels"), extras.get("shift_labels")
        return_logits = extras.get("return_logits") is not False
        if labels is None and shift_labels is None:
            return None, (self.lm_head(hidden) if return_logits else None)
        ignore_index = extras.get("ignore_index")
        ignore_index = -100 if ignore_index is None else ignore_index
        targets = shift_targets(labels, shift_labels, ignore_index)
        total, logits = _token_loss_sum(
            hidden, self.lm_head, targets, ignore_index, return_logits, self.chunk_size
        )
        n = extras.get("num_items_in_batch")
        if n is None:  # a direct call of the layers: the microbatch's mean, as transformers
            n = (targets != ignore_index).sum()
        if isinstance(n, torch.Tensor):
            n = n.to(total.device)
        return total / n, logits

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        extras: dict[str, Any],
    ) -> Any:
        # deferred: transformers is heavy and only Hugging Face models reach this layer
        from transformers.modeling_outputs import CausalLMOutputWithPast

        loss, logits = self.loss_and_logits(hidden, extras)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def decoder_blocks(model: nn.Module, block_cls: type[DecoderBlock] = DecoderBlock) -> list:
    """One ``block_cls`` per decoder layer of a Llama-style ``*ForCausalLM``."""
    base = model.model
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * len(base.layers)
    return [
        block_cls(layer, base.rotary_emb, model.config, types[i] == "sliding_attention")
        for i, layer in enumerate(base.layers)
    ]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Layer list of a Llama-style ``*ForCausalLM`` (switched to SDPA attention, see
    :func:`~roundpipe.models.kernels.prefer_sdpa`)."""
    prefer_sdpa(model)
    base = model.model
    return [
        DecoderEmbed(base.embed_tokens),
        *decoder_blocks(model),
        DecoderHead(base.norm, model.lm_head),
    ]
