"""Published model shapes the planner knows by type and size, written as config-only directories.

``slapo plan --model llama --size 70b`` plans Llama 3.1 70B without its weights: the shape is all
a plan needs. Each entry is the ``config.json`` fields of the published checkpoint that set its
compute and memory (hidden sizes, layers, heads, vocabulary, experts); the rest take the
transformers defaults of its model type.

Example:
    >>> write_model_config("llama", "8b", "llama-8b")
    PosixPath('llama-8b')
    >>> json.loads(Path("llama-8b/config.json").read_text())["num_hidden_layers"]
    32
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .hardware import write_text_atomic
from .step_time import PlanError

__all__ = ["MODEL_SIZES", "model_config", "write_model_config"]

_LLAMA3 = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "hidden_act": "silu",
}  # fmt: skip

#: ``{model type: {size: config fields}}``, from the published ``config.json`` of each model.
MODEL_SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "llama": {  # Llama 3.1 (Meta, 2024)
        "8b": {
            **_LLAMA3,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
        },
        "70b": {
            **_LLAMA3,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
        },
        "405b": {
            **_LLAMA3,
            "hidden_size": 16384,
            "intermediate_size": 53248,
            "num_hidden_layers": 126,
            "num_attention_heads": 128,
            "num_key_value_heads": 8,
        },
    },  # fmt: skip
    "qwen3": {  # Qwen3 (Alibaba, 2025)
        "8b": {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
        },
    },  # fmt: skip
    "mixtral": {  # Mixtral 8x7B (Mistral AI, 2023)
        "8x7b": {
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
        },
    },  # fmt: skip
    "gpt2": {  # GPT-3 175B's shape (Brown et al. 2020, table 2.1) in the GPT-2 architecture
        "175b": {
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "vocab_size": 50257,
            "n_embd": 12288,
            "n_layer": 96,
            "n_head": 96,
            "n_positions": 2048,
        },
    },  # fmt: skip
}


def model_config(model_type: str, size: str) -> dict[str, Any]:
    """The config fields of ``model_type`` at ``size`` (:data:`MODEL_SIZES`).

    Example:
        >>> model_config("llama", "70B")["hidden_size"]
        8192
    """
    sizes = MODEL_SIZES.get(model_type)
    if sizes is None:
        raise PlanError(
            f"--model {model_type} --size {size}: no published sizes of {model_type!r} are known "
            f"(known: {sorted(MODEL_SIZES)}); give a config-only model directory as --model"
        )
    config = sizes.get(size.lower())
    if config is None:
        raise PlanError(f"--size {size}: {model_type} comes in {sorted(sizes)}")
    return dict(config)


def write_model_config(model_type: str, size: str, directory: str | os.PathLike) -> Path:
    """Write the ``config.json`` of ``model_type`` at ``size`` into ``directory`` (atomically),
    a model directory ``slapo train --model`` and ``slapo plan --model`` take (no weights:
    ``slapo train`` initializes them).

    Example:
        >>> write_model_config("llama", "70b", "llama-70b")
        PosixPath('llama-70b')
    """
    config = model_config(model_type, size)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path
