"""RoundPipe preset for Qwen3-MoE: embedding | one layer per decoder block | norm + LM head.

Each block replays its routing in recompute; with ``output_router_logits`` the loss includes
the router load-balancing loss of the whole batch (see :mod:`roundpipe.models.moe`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .decoder import DecoderEmbed, decoder_blocks
from .kernels import prefer_sdpa
from .moe import MoECausalLMRoundPipe, MoEDecoderBlock, MoEDecoderHead

MODEL_CLASSES = ("Qwen3MoeForCausalLM",)


def moe_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Layer list of a Llama-style mixture-of-experts ``*ForCausalLM`` (switched to SDPA
    attention where the model supports it, see :func:`~roundpipe.models.kernels.prefer_sdpa`)."""
    prefer_sdpa(model)
    base = model.model
    return [
        DecoderEmbed(base.embed_tokens),
        *decoder_blocks(model, MoEDecoderBlock),
        MoEDecoderHead(base.norm, model.lm_head),
    ]


def wrap(
    model: nn.Module, root: nn.Module | None = None, **roundpipe_kwargs: Any
) -> MoECausalLMRoundPipe:
    """Wrap a ``Qwen3MoeForCausalLM``; call it like the original (``input_ids``, ``labels``,
    ``output_router_logits``, ...).

    ``root`` is the module the RoundPipe model stands for when it is not ``model`` itself
    (a PEFT model around it); the layers always come from ``model``.

    Example:
        >>> import torch, transformers
        >>> from roundpipe import wrap_model_to_roundpipe
        >>> cfg = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
        ...     num_experts_per_tok=2, moe_intermediate_size=8)
        >>> rp = wrap_model_to_roundpipe(transformers.Qwen3MoeForCausalLM(cfg), pin_model="off")
        >>> ids = torch.randint(0, 32, (2, 5))
        >>> out = rp(input_ids=ids, labels=ids, output_router_logits=True)
        >>> out.aux_loss.shape
        torch.Size([])
    """
    return MoECausalLMRoundPipe(
        model if root is None else root,
        model.config,
        layers=moe_decoder_layers(model),
        **roundpipe_kwargs,
    )
