"""Sequential presets for Hugging Face model families.

A preset turns a ``*ForCausalLM`` model into a list of layers (embedding, one layer per
transformer block, head) that RoundPipe pipelines; the original module tree stays intact,
so checkpoints and attribute access are unchanged.

Attributes:
    SUPPORTED_MODELS: ``config.model_type`` -> preset module path.
    DISABLE_TORCH_COMPILE: presets never call ``torch.compile`` (kept for API parity).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DISABLE_TORCH_COMPILE", "SUPPORTED_MODELS", "find_preset", "wrap_model"]

DISABLE_TORCH_COMPILE = True
SUPPORTED_MODELS: dict[str, str] = {
    "llama": "roundpipe.models.llama",
    "qwen3": "roundpipe.models.qwen3",
    "gpt2": "roundpipe.models.gpt2",
}


def find_preset(model: Any) -> Any | None:
    """The preset module for ``model``, or ``None`` if its family is not supported."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODELS:
        return None
    return importlib.import_module(SUPPORTED_MODELS[model_type])


def wrap_model(model: Any, **roundpipe_kwargs: Any) -> Any:
    """Wrap a supported model with its sequential preset.

    Raises:
        NotImplementedError: the model type has no preset, or its class is not the one the
            preset expects (e.g. a base model without LM head).
    """
    preset = find_preset(model)
    if preset is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise NotImplementedError(
            f"no RoundPipe preset for model type {model_type!r}; "
            f"supported: {sorted(SUPPORTED_MODELS)}"
        )
    if type(model).__name__ not in preset.MODEL_CLASSES:
        raise NotImplementedError(
            f"the {preset.__name__} preset supports {preset.MODEL_CLASSES}, "
            f"got {type(model).__name__}"
        )
    return preset.wrap(model, **roundpipe_kwargs)
