"""The generic preset: any Llama-style transformers causal LM, dense or mixture-of-experts.

A Llama-style ``*ForCausalLM`` holds ``model.embed_tokens``, ``model.layers``, ``model.norm``,
``model.rotary_emb`` and ``lm_head``, and its forward is embedding | blocks | norm + head. The
generic preset cuts it as the Llama preset does; a model whose blocks hold top-k routers gets the
mixture-of-experts layers (routing replayed in recompute, :mod:`roundpipe.models.moe`), with the
router load-balancing loss where the model's own forward adds one (``load_balancing_loss_func``).
Attention runs through SDPA where the model supports it, as in the other presets.

Structure alone does not prove the forward is the plain one (Cohere scales its logits, MiniCPM3
its embeddings and residuals): only the model types whose generic run equals plain PyTorch (loss,
router loss and every gradient; ``benchmarks/roundpipe_model_coverage.py`` checks them all, the
tests a sample) are taken, listed in :data:`GENERIC_MODEL_TYPES`.

Example:
    >>> import torch, transformers
    >>> from roundpipe import wrap_model_to_roundpipe
    >>> cfg = transformers.MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    >>> rp = wrap_model_to_roundpipe(transformers.MistralForCausalLM(cfg), pin_model="off")
    >>> rp.num_layers  # embedding, 2 blocks, head
    4
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from .causal_lm import CausalLMRoundPipe
from .decoder import DecoderEmbed, DecoderHead, decoder_blocks, decoder_layers
from .kernels import prefer_sdpa
from .moe import MoECausalLMRoundPipe, MoEDecoderBlock, MoEDecoderHead, install_router_hooks

__all__ = ["GENERIC_MODEL_TYPES", "MODEL_CLASSES", "is_llama_style", "wrap"]

#: Any class: the structure (:func:`is_llama_style`) and the model type decide.
MODEL_CLASSES = None

#: ``config.model_type`` of the models whose generic run equals plain PyTorch
#: (``benchmarks/roundpipe_model_coverage.py`` on transformers 5.24 tiny configs, 58 types); the
#: presets' own types are not repeated here.
GENERIC_MODEL_TYPES: frozenset[str] = frozenset(
    {
        "apertus",
        "apertus1p5_text",
        "arcee",
        "bitnet",
        "cwm",
        "diffllama",
        "dots1",
        "emu3_text_model",
        "ernie4_5",
        "ernie4_5_moe",
        "exaone",
        "exaone4",
        "exaone_moe",
        "flex_olmo",
        "flint",
        "gemma",
        "gemma2",
        "glm",
        "glm4",
        "glm4_moe",
        "granite",
        "granite_swa",
        "granitemoe",
        "granitemoe_swa",
        "granitemoeshared",
        "helium",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
        "hy_v3",
        "hyperclovax",
        "internlm3",
        "iquestcoder",
        "jais2",
        "jetmoe",
        "kolibri1",
        "llama4_text",
        "minimax_m2",
        "minimax_m3_vl_text",
        "ministral",
        "ministral3",
        "mistral",
        "mixtral",
        "mllama_text_model",
        "nemotron",
        "olmo",
        "olmo2",
        "olmoe",
        "phi3",
        "phi4_multimodal",
        "qwen2",
        "qwen2_moe",
        "sarvam_moe",
        "seed_oss",
        "smollm3",
        "solar_open",
        "stablelm",
        "starcoder2",
        "vaultgemma",
    }
)


class _ReplayOnlyBlock(MoEDecoderBlock):
    """A MoE block of a model whose forward adds no router loss: routing replayed only."""

    router_loss = False


def is_llama_style(model: nn.Module) -> bool:
    """Whether ``model`` has the Llama layout the generic preset cuts.

    Example:
        >>> is_llama_style(nn.Linear(2, 2))
        False
    """
    base = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    return (
        base is not None
        and all(hasattr(base, p) for p in parts)
        and isinstance(base.layers, nn.ModuleList)
        and isinstance(getattr(model, "lm_head", None), nn.Module)
    )


def adds_router_loss(model: nn.Module) -> bool:
    """Whether the model's transformers forward adds the load-balancing loss (its modeling
    module defines ``load_balancing_loss_func`` and its config the coefficient)."""
    module = sys.modules.get(type(model).__module__)
    return hasattr(module, "load_balancing_loss_func") and hasattr(
        model.config, "router_aux_loss_coef"
    )


def wrap(
    model: nn.Module, root: nn.Module | None = None, **roundpipe_kwargs: Any
) -> CausalLMRoundPipe:
    """Wrap a Llama-style ``*ForCausalLM`` of a type in :data:`GENERIC_MODEL_TYPES`; call it
    like the original (``input_ids``, ``labels``, ``output_router_logits``, ...).

    ``root`` is the module the RoundPipe model stands for when it is not ``model`` itself
    (a PEFT model around it); the layers always come from ``model``.

    Raises:
        NotImplementedError: the model is not Llama-style.
    """
    if not is_llama_style(model):
        raise NotImplementedError(
            f"the generic RoundPipe preset needs a Llama-style causal LM (model.embed_tokens, "
            f"model.layers, model.norm, model.rotary_emb, lm_head); {type(model).__name__} is "
            "not one: wrap it with use_sequential_preset=False"
        )
    root = model if root is None else root
    prefer_sdpa(model)
    if install_router_hooks(model) == 0:
        return CausalLMRoundPipe(root, layers=decoder_layers(model), **roundpipe_kwargs)
    base = model.model
    if not adds_router_loss(model):
        layers = [
            DecoderEmbed(base.embed_tokens),
            *decoder_blocks(model, _ReplayOnlyBlock),
            DecoderHead(base.norm, model.lm_head),
        ]
        return CausalLMRoundPipe(root, layers=layers, **roundpipe_kwargs)
    layers = [
        DecoderEmbed(base.embed_tokens),
        *decoder_blocks(model, MoEDecoderBlock),
        MoEDecoderHead(base.norm, model.lm_head),
    ]
    return MoECausalLMRoundPipe(root, model.config, layers=layers, **roundpipe_kwargs)
