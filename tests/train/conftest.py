"""Shared setup of the `slapo train` tests: this folder and tests/ on the path (helpers import by
name, as tests/conftest.py arranges for tests/), and a tiny local Llama directory with a
tokenizer of its own, made here (random weights, nothing downloaded)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for extra in (HERE, HERE.parent):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from your_inputs import LLAMA_POSITIONS, documents, make_tokenizer  # noqa: E402  (path above)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved with save_pretrained, its tokenizer beside it (300 tokens)."""
    import torch
    import transformers as tf

    path = tmp_path_factory.mktemp("models") / "my-llama"
    tokenizer = make_tokenizer(documents())
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LLAMA_POSITIONS,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
