"""The embedded default corpus: byte-level tokens of the Python standard library's own source.

Every Python installation carries it, so the main job trains on real text with no download.
:class:`TokenBatches` draws the same kind of batches from any token stream (``slapo train
--data``, tokenized and cached by :mod:`slapo.train.token_cache`).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from .exceptions import CorpusError, DataError

__all__ = [
    "default_corpus",
    "ByteBatches",
    "MaskedByteBatches",
    "TokenBatches",
    "MaskedTokenBatches",
    "VOCAB_SIZE",
    "MASK_ID",
]

VOCAB_SIZE = 256  # one token per byte
MASK_ID = 0  # the NUL byte never occurs in source text: the [MASK] token of masked-LM batches


def default_corpus(max_bytes: int = 4_000_000) -> bytes:
    """Concatenate stdlib ``.py`` files, in a fixed order, up to ``max_bytes``.

    Example:
        >>> len(default_corpus(20_000))
        20000
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if len(corpus) < 10_000:
        raise CorpusError(f"the standard library at {root} holds too little source to train on")
    return corpus


class _SeededBatches:
    """Batches drawn with one seeded generator; its state is the whole resume state."""

    def __init__(self, batch_size: int, seq_len: int, seed: int) -> None:
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])


class ByteBatches(_SeededBatches):
    """Random windows of a byte corpus as ``(input_ids, labels)`` batches, reproducible by seed.

    ``labels`` equal ``input_ids``: transformers causal-LM models shift them internally.

    Example:
        >>> batches = ByteBatches(default_corpus(20_000), batch_size=2, seq_len=8, seed=0)
        >>> batch = batches.next()
        >>> batch["input_ids"].shape
        torch.Size([2, 8])
    """

    def __init__(self, corpus: bytes, batch_size: int, seq_len: int, seed: int = 0) -> None:
        if len(corpus) <= seq_len:
            raise DataError(f"corpus of {len(corpus)} bytes is shorter than seq_len={seq_len}")
        super().__init__(batch_size, seq_len, seed)
        self.tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()

    def next(self) -> dict[str, torch.Tensor]:
        starts = torch.randint(
            0, len(self.tokens) - self.seq_len, (self.batch_size,), generator=self.generator
        )
        ids = torch.stack([self.tokens[s : s + self.seq_len] for s in starts.tolist()])
        return {"input_ids": ids, "labels": ids.clone()}


class MaskedByteBatches(ByteBatches):
    """Masked-LM batches (BERT): ``mask_prob`` of the positions become ``MASK_ID``; only they
    carry a label (the others are -100). Reproducible by seed, like :class:`ByteBatches`.

    Example:
        >>> batch = MaskedByteBatches(default_corpus(20_000), 2, 16, seed=0).next()
        >>> bool(((batch["labels"] == -100) | (batch["input_ids"] == MASK_ID)).all())
        True
    """

    def __init__(
        self, corpus: bytes, batch_size: int, seq_len: int, seed: int = 0, mask_prob: float = 0.15
    ) -> None:
        super().__init__(corpus, batch_size, seq_len, seed)
        if not 0 < mask_prob < 1:
            raise DataError(f"mask_prob must lie in (0, 1), got {mask_prob}")
        self.mask_prob = mask_prob

    def next(self) -> dict[str, torch.Tensor]:
        return _mask(super().next()["input_ids"], self.generator, self.mask_prob)


def _mask(
    ids: torch.Tensor, generator: torch.Generator, mask_prob: float
) -> dict[str, torch.Tensor]:
    """A masked-LM batch of ``ids``: ``mask_prob`` of the positions become ``MASK_ID`` and
    carry their id as the label (the others -100), at least one per row."""
    masked = torch.rand(ids.shape, generator=generator) < mask_prob
    masked[:, 0] = True  # at least one label per row
    return {
        "input_ids": ids.masked_fill(masked, MASK_ID),
        "labels": ids.masked_fill(~masked, -100),
    }


class TokenBatches(_SeededBatches):
    """Batches of a token stream packed into ``seq_len`` windows, drawn at random (with
    replacement), reproducible by seed; ``labels`` equal ``input_ids`` as in :class:`ByteBatches`.

    ``tokens`` may be memory-mapped (``torch.from_file``) in any integer dtype: only the windows
    of a batch are read and widened to int64.

    Example:
        >>> batches = TokenBatches(torch.arange(100, dtype=torch.int32), 2, 10, seed=0)
        >>> batches.next()["input_ids"][:, 0] % 10
        tensor([0, 0])
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0) -> None:
        self.windows = len(tokens) // seq_len
        if self.windows < 1:
            raise DataError(f"{len(tokens)} tokens are fewer than seq_len={seq_len}")
        super().__init__(batch_size, seq_len, seed)
        self.tokens = tokens

    def next(self) -> dict[str, torch.Tensor]:
        picks = torch.randint(0, self.windows, (self.batch_size,), generator=self.generator)
        n = self.seq_len
        ids = torch.stack([self.tokens[w * n : (w + 1) * n] for w in picks.tolist()]).long()
        return {"input_ids": ids, "labels": ids.clone()}


class MaskedTokenBatches(TokenBatches):
    """Masked-LM batches of a token stream (BERT), masked as :class:`MaskedByteBatches`.

    Example:
        >>> batch = MaskedTokenBatches(torch.arange(1, 101), 2, 10, seed=0).next()
        >>> bool(((batch["labels"] == -100) | (batch["input_ids"] == MASK_ID)).all())
        True
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        mask_prob: float = 0.15,
    ) -> None:
        super().__init__(tokens, batch_size, seq_len, seed)
        if not 0 < mask_prob < 1:
            raise DataError(f"mask_prob must lie in (0, 1), got {mask_prob}")
        self.mask_prob = mask_prob

    def next(self) -> dict[str, torch.Tensor]:
        return _mask(super().next()["input_ids"], self.generator, self.mask_prob)
