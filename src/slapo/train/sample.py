"""A few lines of text from a trained model of the main job: what the loss curve bought.

Causal models continue a prompt (``def ``, or the beginning of ``--data``), in the run's
tokens; BERT fills in the masked bytes of a line of the corpus; T5 (trained to copy its input)
reproduces one.

Example:
    >>> from slapo.train import TrainConfig
    >>> from slapo.train.presets import build_model
    >>> model = build_model(TrainConfig(model="llama", preset="tiny"))  # random weights
    >>> lines = sample_text(model, "llama", seed=0, new_tokens=16)
    >>> lines[0][:4]  # the prompt, then what the model adds (gibberish before training)
    'def '
"""

from __future__ import annotations

import torch
from torch import nn

from ..data import MASK_ID, default_corpus
from .model_source import max_positions
from .tokenizer import ByteTokenizer, Tokenizer, render_bytes

__all__ = ["PROMPT", "sample_text"]

#: The prompt the causal models continue (the corpus is Python source).
PROMPT = b"def "


def _text(ids: torch.Tensor) -> str:
    """Bytes as text, one character per byte (:func:`~slapo.train.tokenizer.render_bytes`)."""
    return render_bytes(ids.tolist())


def _corpus_line(length: int, seed: int) -> torch.Tensor:
    """A window of the corpus that starts at a line, chosen by ``seed``."""
    corpus = default_corpus(200_000)
    start = corpus.find(b"\n", (seed * 7919 + 1000) % (len(corpus) - 4 * length)) + 1
    window = corpus[start : start + length]
    return torch.frombuffer(bytearray(window), dtype=torch.uint8).long()[None]


@torch.no_grad()
def sample_text(
    model: nn.Module,
    family: str,
    seed: int = 0,
    new_tokens: int = 160,
    tokenizer: Tokenizer | None = None,
    prompt: list[int] | None = None,
) -> list[str]:
    """Text from ``model`` (a transformers model of the main job's ``family``, or ``"causal"``
    for any causal LM), as lines.

    A causal model continues ``prompt`` (ids; default ``def `` in bytes), decoded with
    ``tokenizer`` (default: one token per byte). Sampling (temperature 0.8, top-k 40) is seeded
    with ``seed``; the model is put back in the train/eval mode it was in.

    Example:
        >>> from slapo.train import TrainConfig
        >>> from slapo.train.presets import build_model
        >>> sample_text(build_model(TrainConfig(model="gpt2")), "gpt2", new_tokens=8)[0][:4]
        'def '
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        if family not in ("bert", "t5"):
            tokenizer = tokenizer or ByteTokenizer()
            ids = list(PROMPT) if prompt is None else prompt
            positions = max_positions(model.config)
            if positions is not None:
                new_tokens = min(new_tokens, positions - len(ids))
            generator_state = torch.random.get_rng_state()
            torch.manual_seed(seed)
            try:
                out = model.generate(
                    torch.tensor([ids], device=device), max_new_tokens=new_tokens,
                    do_sample=True, temperature=0.8, top_k=40, use_cache=True, pad_token_id=0,
                )  # fmt: skip
            finally:
                torch.random.set_rng_state(generator_state)
            return tokenizer.decode(out[0].tolist()).splitlines()
        line = _corpus_line(min(new_tokens, 96), seed).to(device)
        if family == "bert":
            gen = torch.Generator().manual_seed(seed)
            masked = (torch.rand(line.shape, generator=gen) < 0.15).to(device)
            ids = line.masked_fill(masked, MASK_ID)
            guess = model(input_ids=ids).logits.argmax(-1)
            filled = torch.where(masked, guess, line)
            return ["masked:  " + _text(ids[0]).replace("\n", " "),
                    "filled:  " + _text(filled[0]).replace("\n", " ")]  # fmt: skip
        out = model.generate(line, max_new_tokens=line.shape[1], do_sample=False, use_cache=True)
        return ["input:   " + _text(line[0]).replace("\n", " "),
                "output:  " + _text(out[0, 1:]).replace("\n", " ")]  # fmt: skip
    finally:
        model.train(was_training)
