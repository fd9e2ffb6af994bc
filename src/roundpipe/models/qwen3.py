"""RoundPipe preset for Qwen3 (dense): embedding | one layer per decoder block | norm + LM head."""

from __future__ import annotations

from typing import Any

from torch import nn

from .causal_lm import CausalLMRoundPipe
from .decoder import decoder_layers

MODEL_CLASSES = ("Qwen3ForCausalLM",)


def wrap(
    model: nn.Module, root: nn.Module | None = None, **roundpipe_kwargs: Any
) -> CausalLMRoundPipe:
    """Wrap a ``Qwen3ForCausalLM``; call it like the original (``input_ids``, ``labels``, ...).

    ``root`` is the module the RoundPipe model stands for when it is not ``model`` itself
    (a PEFT model around it); the layers always come from ``model``.
    """
    return CausalLMRoundPipe(
        model if root is None else root, layers=decoder_layers(model), **roundpipe_kwargs
    )
