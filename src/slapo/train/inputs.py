"""What a run trains on, resolved and checked before anything is built or written.

:func:`prepare_inputs` reads ``--model``, ``--tokenizer``, ``--data`` and ``--seq-len``
together: the tokenizer must fit the model's embeddings, the sequence its positions, the data
at least one sequence. Each problem is an :class:`~slapo.train.config.InputError` that names
the flag or file and how to fix it (``slapo train`` exits with status 2, writing nothing).

Example:
    >>> from pathlib import Path
    >>> from slapo.train import TrainConfig, prepare_inputs
    >>> _ = Path("notes.txt").write_text("Plain text to train on, one byte per token. " * 200)
    >>> inputs = prepare_inputs(TrainConfig(model="phi3", data="notes.txt"))
    >>> inputs.tokenizer.name, inputs.tokens.dtype
    ('bytes', torch.uint16)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..data import VOCAB_SIZE, default_corpus
from ..exceptions import InputError
from .config import TrainConfig
from .generic_schedule import check_knobs
from .job_layout import schedule_family
from .model_source import ModelSource, check_weights, config_for, max_positions, resolve_model
from .token_cache import TokenData, load_tokens, tokens_of_text
from .tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["PROMPT", "RunInputs", "prepare_inputs"]

#: The prompt the trained model continues: the embedded corpus is Python source.
PROMPT = "def "
#: Tokens of the data's own beginning that prompt the trained model (with --data).
DATA_PROMPT_TOKENS = 4


@dataclass
class RunInputs:
    """The resolved model, tokenizer and data of a run.

    Attributes:
        source: what ``--model`` names.
        tokenizer: the run's tokenizer.
        tokens: the token stream (None: the embedded corpus, one token per byte).
        data: ``--data``'s cache (None without ``--data``).
        prompt: the ids the trained model continues at the end of the run.
        name: what the data is (``--data``'s path, or the embedded corpus).
        corpus: the embedded corpus's bytes trained on (None: all of it, or ``tokens``).
        eval_tokens: the held-out data (bytes of the embedded corpus, or tokens; None: none).
        eval_name: what the held-out data is.
    """

    source: ModelSource
    tokenizer: Tokenizer
    tokens: torch.Tensor | None = None
    data: TokenData | None = None
    prompt: list[int] = field(default_factory=list)
    name: str = "embedded corpus"
    corpus: bytes | None = None
    eval_tokens: bytes | torch.Tensor | None = None
    eval_name: str | None = None

    def describe(self) -> dict[str, Any]:
        """The data of the run, for ``metrics.json`` and the summary."""
        return {
            "data": self.name,
            "tokenizer": self.tokenizer.name,
            "tokens": None if self.tokens is None else len(self.tokens),
            "token_cache": None
            if self.data is None or self.data.path is None
            else str(self.data.path),
            "from_cache": None if self.data is None else self.data.cached,
            "eval_data": self.eval_name,
        }


def _model_shape(cfg: TrainConfig, source: ModelSource) -> tuple[int, int | None]:
    """The model's embedding rows and its positions (None: bounded by nothing)."""
    if source.kind == "family":
        return VOCAB_SIZE, None  # the families are built with room for --seq-len positions
    config = config_for(source, cfg.preset, cfg.seq_len, cfg.tokenizer)
    return config.vocab_size, max_positions(config)


def prepare_inputs(cfg: TrainConfig) -> RunInputs:
    """Resolve and check ``cfg``'s model, tokenizer and data; tokenize (or map the cache).

    Example:
        >>> prepare_inputs(TrainConfig()).tokens is None   # the embedded corpus, as bytes
        True
    """
    source = resolve_model(cfg.model)
    if source.kind == "dir":  # training reads the weights (planning a model needs none)
        check_weights(source)
    tokenizer = load_tokenizer(cfg.tokenizer, source.path)
    vocab, positions = _model_shape(cfg, source)
    if tokenizer.vocab_size > vocab:
        flag = f"--tokenizer {cfg.tokenizer}" if cfg.tokenizer else f"--model {cfg.model}"
        raise InputError(
            f"{flag}: the tokenizer ({tokenizer.name}) has {tokenizer.vocab_size} tokens, more "
            f"than the {vocab} embeddings of --model {cfg.model}; pass the model's own "
            "tokenizer with --tokenizer"
        )
    if positions is not None and cfg.seq_len > positions:
        raise InputError(
            f"--seq-len {cfg.seq_len} is beyond the {positions} positions of --model "
            f"{cfg.model}; pass --seq-len {positions} or less"
        )
    if not cfg.unscheduled and source.kind != "family" and schedule_family(cfg.model) is None:
        # before the baseline trains: the generic plan is applied after it
        check_knobs({"fuse_ops": cfg.fuse_ops})
    inputs = RunInputs(source, tokenizer)
    if cfg.data is not None:
        inputs.name = cfg.data
        inputs.data = load_tokens(cfg.data, cfg.data_field, tokenizer)
        inputs.tokens = inputs.data.tokens
        if len(inputs.tokens) < cfg.seq_len:
            raise InputError(
                f"--data {cfg.data} holds {len(inputs.tokens)} tokens, fewer than one sequence "
                f"of --seq-len {cfg.seq_len}; give more text or a smaller --seq-len"
            )
        inputs.prompt = inputs.tokens[:DATA_PROMPT_TOKENS].tolist()
    else:
        if not isinstance(tokenizer, ByteTokenizer):  # the embedded corpus in the model's tokens
            inputs.tokens = tokens_of_text(default_corpus().decode("utf-8", "replace"), tokenizer)
        inputs.prompt = tokenizer.encode([PROMPT])[0]
    _hold_out(cfg, inputs)
    return inputs


def _hold_out(cfg: TrainConfig, inputs: RunInputs) -> None:
    """Set ``inputs``' eval data: ``--eval-data`` tokenized as ``--data`` is, or the last
    ``--eval-fraction`` of the training data cut off (each part at least one sequence)."""
    if cfg.eval_data is not None:
        data = load_tokens(cfg.eval_data, cfg.data_field, inputs.tokenizer)
        inputs.eval_tokens, inputs.eval_name = data.tokens, cfg.eval_data
        if len(data.tokens) < cfg.seq_len:
            raise InputError(
                f"--eval-data {cfg.eval_data} holds {len(data.tokens)} tokens, fewer than one "
                f"sequence of --seq-len {cfg.seq_len}; give more text or a smaller --seq-len"
            )
        return
    if cfg.eval_fraction is None:
        return
    stream = inputs.tokens if inputs.tokens is not None else default_corpus()
    cut = int(len(stream) * (1 - cfg.eval_fraction))
    # bytes windows start anywhere before the end: one more byte than a sequence
    need = cfg.seq_len + (inputs.tokens is None)
    for part, size in (("training", cut), ("evaluation", len(stream) - cut)):
        if size < need:
            raise InputError(
                f"--eval-fraction {cfg.eval_fraction} leaves {size} tokens for {part}, fewer "
                f"than one sequence of --seq-len {cfg.seq_len}; pass a fraction nearer 0.5, "
                "more data or a smaller --seq-len"
            )
    if inputs.tokens is None:
        inputs.corpus = stream[:cut]
    else:
        inputs.tokens = stream[:cut]
    inputs.eval_tokens = stream[cut:]
    inputs.eval_name = f"the last {cfg.eval_fraction:g} of {inputs.name}"
