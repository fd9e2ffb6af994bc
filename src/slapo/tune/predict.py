"""``slapo tune --predict DEVICE``: the trials the planner predicts fastest first, those it
predicts cannot fit the device never run.

Each configuration is predicted before any trial (:func:`slapo.plan.predict_config` through the
command predictor ``slapo.plan`` registers: fake steps, nothing allocated): the exhaustive
strategy then measures them in the order of their predicted tokens/s, so that a ``--budget`` of
trials spends itself on the likeliest winners, and one whose predicted memory exceeds the device
is skipped with that reason (the memory screen of :mod:`slapo.tune.memory_budget`, the prediction's
memory estimate as its estimate).

Example:
    slapo tune --config examples/tune_schedule.py --db db.json --predict h100 --budget 4 \\
        -- slapo train --model llama --steps 20 --no-progress --json
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .space import Value

__all__ = [
    "CommandPredictor", "Predictor", "command_predictor", "rank_by_prediction",
    "register_command_predictor",
]  # fmt: skip

#: ``predict(cfg)`` -> a :class:`slapo.plan.StepPrediction` (or None when unknown).
Predictor = Callable[[Mapping[str, Value]], Any]

#: ``fn(command, device)`` -> (the trials' predictor, the device's memory in bytes), or None.
CommandPredictor = Callable[[Sequence[str], str], "tuple[Predictor, int] | None"]
_COMMAND_PREDICTORS: list[CommandPredictor] = []


def register_command_predictor(fn: CommandPredictor) -> CommandPredictor:
    """Register ``fn(command, device)``: the predictor of the trials of ``command`` on
    ``device`` (a name or a device file, as ``--predict`` gives it) with that device's memory
    in bytes, or None when it does not know the command (``slapo.plan`` registers one for
    ``slapo train``; the tuner sits below the planner and the main job and imports neither).

    Example:
        >>> @register_command_predictor
        ... def nothing(command, device):
        ...     return None
        >>> command_predictor(["my-trainer"], "h100") is None
        True
        >>> _COMMAND_PREDICTORS.remove(nothing)
    """
    _COMMAND_PREDICTORS.append(fn)
    return fn


def command_predictor(command: Sequence[str], device: str) -> tuple[Predictor, int] | None:
    """What the first registered command predictor that knows ``command`` gives for it on
    ``device``: (the trials' predictor, the device's memory in bytes); else None."""
    for fn in _COMMAND_PREDICTORS:
        found = fn(command, device)
        if found is not None:
            return found
    return None


def rank_by_prediction(
    configs: Sequence[Mapping[str, Value]], predict: Predictor
) -> tuple[list[Mapping[str, Value]], dict[int, Any]]:
    """``configs`` fastest predicted first (tokens/s per GPU; those without a prediction last,
    in their order), and each one's prediction by its index in the result.

    Example:
        >>> class P:
        ...     def __init__(self, t): self.tokens_per_s_per_gpu = t
        >>> ranked, _ = rank_by_prediction([{"bs": 1}, {"bs": 4}, {"bs": 2}],
        ...                                lambda cfg: P(cfg["bs"] * 10.0))
        >>> [c["bs"] for c in ranked]
        [4, 2, 1]
    """
    predictions: list[Any] = []
    for cfg in configs:
        try:
            predictions.append(predict(cfg))
        except Exception:  # noqa: BLE001  (no prediction: the trial decides, ranked last)
            predictions.append(None)

    def key(i: int) -> tuple[int, float]:
        pred = predictions[i]
        if pred is None:
            return (1, 0.0)
        return (0, -float(pred.tokens_per_s_per_gpu))

    order = sorted(range(len(configs)), key=key)
    return [configs[i] for i in order], {new: predictions[i] for new, i in enumerate(order)}
