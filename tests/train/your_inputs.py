"""Inputs of the `slapo train --model/--data` tests: a corpus of short documents, JSON lines
of them, and a small byte-level BPE tokenizer trained on them (offline)."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = "the quick brown fox jumps over a lazy dog while cats sleep in the warm sun".split()
#: Positions of the tiny Llama directory: a --seq-len beyond it is refused.
LLAMA_POSITIONS = 64


def documents(count: int = 300, seed: int = 0) -> list[str]:
    """Short documents of a few words: text whose loss falls within a few dozen steps."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 25))) for _ in range(count)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def make_tokenizer(docs: list[str], vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on ``docs``, with ``</s>`` as its end of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
