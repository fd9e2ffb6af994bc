"""``--eval-data`` / ``--eval-fraction`` with ``--eval-every``: the loss and perplexity of the
model on held-out data, without gradients, in eval mode (no dropout).

The eval batches are drawn once, with a seed of their own, so every evaluation of a run (and of
a resumed run) sees the same tokens, and evaluating draws nothing from the training's RNG.

Example:
    >>> from slapo.train import TrainConfig, prepare_inputs
    >>> from slapo.train.evaluation import Evaluator, eval_batches
    >>> from slapo.train.presets import build_model
    >>> cfg = TrainConfig(eval_fraction=0.1)
    >>> inputs = prepare_inputs(cfg)
    >>> # the numbers are those of a model trained a while; a fresh one scores worse: not run here
    >>> model = build_model(cfg)  # doctest: +SKIP
    >>> evaluator = Evaluator(eval_batches(cfg, inputs))
    >>> evaluator(model)  # doctest: +SKIP
    {'loss': 4.81, 'perplexity': 122.7}
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..data import ByteBatches, MaskedByteBatches, MaskedTokenBatches, TokenBatches
from ..targets.contract import output_loss
from .config import TrainConfig
from .inputs import RunInputs

__all__ = ["EVAL_BATCHES", "EVAL_SEED", "Evaluator", "eval_batches", "wants_eval"]

#: Batches of ``--batch-size`` sequences in each evaluation.
EVAL_BATCHES = 4
#: Added to ``--seed`` for the eval batches: apart from every rank's training draws.
EVAL_SEED = 7_919


def eval_batches(cfg: TrainConfig, inputs: RunInputs) -> list[dict[str, torch.Tensor]]:
    """The batches every evaluation of the run scores (the same on every rank).

    Example:
        >>> from slapo.train import prepare_inputs
        >>> cfg = TrainConfig(eval_fraction=0.1)
        >>> len(eval_batches(TrainConfig(eval_fraction=0.1), prepare_inputs(cfg)))
        4
    """
    data = inputs.eval_tokens
    assert data is not None
    seed = cfg.seed + EVAL_SEED
    if isinstance(data, bytes):
        cls = MaskedByteBatches if cfg.model == "bert" else ByteBatches
    else:
        cls = MaskedTokenBatches if cfg.model == "bert" else TokenBatches
    batches = cls(data, cfg.batch_size, cfg.seq_len, seed=seed)
    return [batches.next() for _ in range(EVAL_BATCHES)]


def wants_eval(cfg: TrainConfig, step: int) -> bool:
    """Whether the run evaluates after ``step`` (1-based): every ``--eval-every`` steps and
    after the last.

    Example:
        >>> [s for s in range(1, 8) if wants_eval(TrainConfig(steps=7, eval_every=3), s)]
        [3, 6, 7]
    """
    every = cfg.eval_every
    return step == cfg.steps or (every is not None and step % every == 0)


class Evaluator:
    """The mean loss over fixed batches, and its perplexity ``exp(loss)``.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2)
        >>> model = transformers.GPT2LMHeadModel(config)
        >>> ids = torch.randint(0, 50257, (2, 8))
        >>> batches = [{"input_ids": ids, "labels": ids}]
        >>> Evaluator(batches)(model)["perplexity"] > 1
        True
    """

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches = batches

    @torch.no_grad()
    def __call__(self, model: Any) -> dict[str, float]:
        device = _device(model)
        was_training = getattr(model, "training", True)
        model.eval()
        # nothing draws in eval mode; should anything, the training's RNG streams stay put
        cuda = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=cuda):
                losses = [self._loss(model, batch, device) for batch in self.batches]
        finally:
            model.train(was_training)
        loss = sum(losses) / len(losses)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}  # exp(710) overflows

    @staticmethod
    def _loss(model: Any, batch: dict[str, torch.Tensor], device: torch.device) -> float:
        return float(output_loss(model(**{k: v.to(device) for k, v in batch.items()})))


def _device(model: Any) -> torch.device:
    params = getattr(model, "parameters", None)
    first = next(iter(params()), None) if callable(params) else None
    return torch.device("cpu") if first is None else first.device
