"""RoundPipe preset for GPT-OSS: embedding | one layer per decoder block | norm + LM head.

Blocks alternate sliding-window and full attention (each builds its own mask); every block is
a mixture of experts whose routing is replayed in recompute, and ``output_router_logits`` adds
the router load-balancing loss of the whole batch (see :mod:`roundpipe.models.moe`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .moe import MoECausalLMRoundPipe
from .qwen3_moe import moe_decoder_layers

MODEL_CLASSES = ("GptOssForCausalLM",)


def wrap(
    model: nn.Module, root: nn.Module | None = None, **roundpipe_kwargs: Any
) -> MoECausalLMRoundPipe:
    """Wrap a ``GptOssForCausalLM``; call it like the original (``input_ids``, ``labels``,
    ``output_router_logits``, ...).

    ``root`` is the module the RoundPipe model stands for when it is not ``model`` itself
    (a PEFT model around it); the layers always come from ``model``.
    """
    return MoECausalLMRoundPipe(
        model if root is None else root,
        model.config,
        layers=moe_decoder_layers(model),
        **roundpipe_kwargs,
    )
