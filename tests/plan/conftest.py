"""A small Llama as a config-only model directory, the planner's input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

#: Four layers, grouped-query attention, a vocabulary large enough that the loss's float32
#: logits matter: the shapes the planner's depth extension and engine models must get right.
SMALL_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}  # fmt: skip


@pytest.fixture(scope="session")
def small_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    path: Path = tmp_path_factory.mktemp("small-llama")
    (path / "config.json").write_text(json.dumps(SMALL_LLAMA))
    return str(path)
