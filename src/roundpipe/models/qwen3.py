"""RoundPipe preset for Qwen3 (dense): embedding | one layer per decoder block | norm + LM head."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..roundpipe import RoundPipe
from .decoder import decoder_layers

MODEL_CLASSES = ("Qwen3ForCausalLM",)


def wrap(model: nn.Module, **roundpipe_kwargs: Any) -> RoundPipe:
    """Wrap a ``Qwen3ForCausalLM``; call it like the original (``input_ids``, ``labels``, ...)."""
    return RoundPipe(model, layers=decoder_layers(model), **roundpipe_kwargs)
