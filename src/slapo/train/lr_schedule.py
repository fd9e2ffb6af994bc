"""``--lr-schedule`` and ``--warmup-steps``: the learning rate of every step, as a
``torch.optim.lr_scheduler.LambdaLR`` whose state ``--save`` keeps and ``--resume`` restores.

Step ``s`` (0-based: the ``s``-th optimizer update) trains at ``--lr`` times :class:`LRFactor`:
``(s + 1) / W`` during a warmup of ``W`` steps (no update at learning rate 0), then ``1``
(constant), or a decay over the remaining steps to ``--steps``: cosine ``(1 + cos(pi p)) / 2`` or
linear ``1 - p``, with ``p = (s - W) / (steps - W)``.

Example:
    >>> factor = LRFactor("linear", warmup=2, total=6)
    >>> [factor(s) for s in range(6)]
    [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..exceptions import SlapoError
from .config import LR_SCHEDULES, TrainConfig

__all__ = ["LRFactor", "lr_factors", "make_scheduler"]


@dataclass
class LRFactor:
    """The learning-rate factor of step ``s`` (0-based) under one schedule.

    Example:
        >>> LRFactor("cosine", warmup=0, total=4)(2)
        0.5
    """

    schedule: str
    warmup: int
    total: int

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.schedule == "constant":
            return 1.0
        progress = min((step - self.warmup) / max(self.total - self.warmup, 1), 1.0)
        if self.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress


def lr_factors(cfg: TrainConfig) -> LRFactor:
    """The :class:`LRFactor` of a run's flags.

    Example:
        >>> lr_factors(TrainConfig(lr_schedule="cosine", warmup_steps=10, steps=100)).warmup
        10
    """
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise SlapoError(f"--lr-schedule must be one of {LR_SCHEDULES}, got {cfg.lr_schedule!r}")
    return LRFactor(cfg.lr_schedule, cfg.warmup_steps, cfg.steps)


class _Schedule(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR whose state leaves out the factor itself: a resumed run decays to its own
    ``--steps`` (the state keeps where the schedule stands: the step and base rates)."""

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("lr_lambdas", None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = {k: v for k, v in state_dict.items() if k != "lr_lambdas"}
        self.__dict__.update(state)


def make_scheduler(optimizer: Any, cfg: TrainConfig) -> Any:
    """The run's learning-rate scheduler over ``optimizer``: call ``step()`` after each
    ``optimizer.step()``; None for an optimizer that is no ``torch.optim.Optimizer`` (an
    engine's own) when the schedule is constant without warmup, which then needs none.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> cfg = TrainConfig(lr_schedule="linear", warmup_steps=10, steps=100)
        >>> sched = make_scheduler(torch.optim.AdamW(model.parameters(), lr=1.0), cfg)
        >>> sched.get_last_lr()
        [0.1]
    """
    factor = lr_factors(cfg)
    try:
        return _Schedule(optimizer, factor)
    except TypeError as exc:  # not a torch optimizer (DeepSpeed's ZeRO optimizer)
        if cfg.lr_schedule == "constant" and cfg.warmup_steps == 0:
            return None
        raise SlapoError(
            f"--lr-schedule/--warmup-steps are not wired for --target {cfg.target}: its "
            f"optimizer is a {type(optimizer).__name__} ({exc})"
        ) from exc
