"""Sequential presets for Hugging Face model families.

A preset turns a ``*ForCausalLM`` model into a list of layers (embedding, one layer per
transformer block, head) that RoundPipe pipelines; the original module tree stays intact,
so checkpoints and attribute access are unchanged.

The wrapped model (:class:`~roundpipe.models.causal_lm.CausalLMRoundPipe`) is called like the
transformers model. Its ``loss`` is the whole batch's however the batch is split into
microbatches (``num_items_in_batch`` honoured as transformers honours it); with
``return_logits=False`` the head and the loss run over chunks of tokens and the logits are never
materialised (:mod:`roundpipe.models.loss`). Mixture-of-experts presets replay each block's
routing in recompute and add the router load-balancing loss of the whole batch
(:mod:`roundpipe.models.moe`).

A ``peft`` adapter model (``PeftModel`` -> ``LoraModel`` -> ``LlamaForCausalLM``, ...) uses the
preset of the transformers model inside it: the layers come from that model (its blocks now hold
the adapter modules) while the RoundPipe root stays the PEFT model, so ``save_pretrained`` and
the parameter names are PEFT's. Prompt-learning adapters (prefix / prompt tuning) change the
forward itself and get no preset.

Attributes:
    SUPPORTED_MODELS: ``config.model_type`` -> preset module path.
    DISABLE_TORCH_COMPILE: whether the presets' blocks skip ``torch.compile``: ``True`` never
        compiles, ``False`` always compiles, ``None`` (default) compiles on CUDA devices and, on
        CPU virtual devices, only with ``ROUNDPIPE_TORCH_COMPILE=1`` (read at each call; see
        :mod:`roundpipe.models.kernels`).
    PREFER_SDPA: presets switch a model whose attention is unset or ``"eager"`` to SDPA
        (``torch.nn.functional.scaled_dot_product_attention``: FlashAttention / memory-efficient
        kernels on CUDA). Set it to False before wrapping to keep eager attention.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["DISABLE_TORCH_COMPILE", "PREFER_SDPA", "SUPPORTED_MODELS", "find_preset", "wrap_model"]

DISABLE_TORCH_COMPILE: bool | None = None
PREFER_SDPA = True
SUPPORTED_MODELS: dict[str, str] = {
    "llama": "roundpipe.models.llama",
    "qwen3": "roundpipe.models.qwen3",
    "gpt2": "roundpipe.models.gpt2",
    "qwen3_moe": "roundpipe.models.qwen3_moe",
    "gpt_oss": "roundpipe.models.gpt_oss",
}


def peft_base_model(model: Any) -> tuple[bool, Any]:
    """``(is_peft, inner)``: whether ``model`` is a PEFT wrapper, and the transformers model
    whose layers a preset pipelines (``model`` itself when it is not a PEFT wrapper; ``None``
    for a prompt-learning adapter, whose forward must not be bypassed).

    Example:
        >>> import torch
        >>> peft_base_model(torch.nn.Linear(2, 2))[0]
        False
    """
    if "peft" not in sys.modules:  # a PEFT model exists only once peft was imported
        return False, model
    # deferred: peft is optional; it is already imported here
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner  # deferred: as above

    inner = model
    if isinstance(inner, PeftModel):
        if inner.active_peft_config.is_prompt_learning:
            return True, None  # its forward prepends virtual tokens to every call
        inner = inner.base_model
    if isinstance(inner, BaseTuner):  # LoraModel & co.: forward is the wrapped model's forward
        return True, inner.model
    return inner is not model, inner


def generic_model_types() -> frozenset[str]:
    """The model types the generic preset takes (:mod:`roundpipe.models.generic_preset`)."""
    return importlib.import_module("roundpipe.models.generic_preset").GENERIC_MODEL_TYPES


def find_preset(model: Any) -> Any | None:
    """The preset module for ``model`` (or for the model inside a PEFT adapter wrapper), or
    ``None`` if its family is not supported."""
    _, inner = peft_base_model(model)
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if model_type in SUPPORTED_MODELS:
        return importlib.import_module(SUPPORTED_MODELS[model_type])
    generic = importlib.import_module("roundpipe.models.generic_preset")
    if model_type in generic.GENERIC_MODEL_TYPES and generic.is_llama_style(inner):
        return generic
    return None


def wrap_model(model: Any, **roundpipe_kwargs: Any) -> Any:
    """Wrap a supported model with its sequential preset.

    Raises:
        NotImplementedError: the model type has no preset, or its class is not the one the
            preset expects (e.g. a base model without LM head).
    """
    is_peft, inner = peft_base_model(model)
    if inner is None:
        raise NotImplementedError(
            f"no RoundPipe preset for a prompt-learning PEFT model ({type(model).__name__}): its "
            "forward adds virtual tokens; wrap it with use_sequential_preset=False"
        )
    preset = find_preset(model)
    if preset is None:
        model_type = getattr(getattr(inner, "config", None), "model_type", None)
        raise NotImplementedError(
            f"no RoundPipe preset for model type {model_type!r}; supported: "
            f"{sorted(SUPPORTED_MODELS)} and, through the generic preset, "
            f"{len(generic_model_types())} Llama-style types (roundpipe.models.generic_preset)"
        )
    if preset.MODEL_CLASSES is not None and type(inner).__name__ not in preset.MODEL_CLASSES:
        raise NotImplementedError(
            f"the {preset.__name__} preset supports {preset.MODEL_CLASSES}, "
            f"got {type(inner).__name__}"
        )
    if is_peft:  # layers from the inner model, the PEFT model stays the root
        return preset.wrap(inner, root=model, **roundpipe_kwargs)
    return preset.wrap(model, **roundpipe_kwargs)
