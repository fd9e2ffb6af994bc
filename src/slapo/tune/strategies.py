"""Search strategies: which configuration to measure next.

A strategy sees the finite list of configurations and the scores measured so far (higher is
better; ``None`` for a failed trial), and proposes the index of an unmeasured configuration.
Because it only reads scores, a resumed tuning run feeds the records of earlier runs into
the model for free.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence

import torch

from .errors import TuneTypeError, TuneValueError
from .model import GaussianProcess, encode, expected_improvement, feasibility
from .space import Value

Scores = Mapping[int, float | None]


class Strategy:
    """Base class: subclasses implement :meth:`propose`.

    Example:
        >>> s = Exhaustive([{"bs": 1}, {"bs": 2}])
        >>> s.propose({}), s.propose({0: 1.0}), s.propose({0: 1.0, 1: 2.0})
        (0, 1, None)
    """

    name = "base"

    def __init__(self, configs: Sequence[Mapping[str, Value]], seed: int = 0) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TuneTypeError(f"seed must be an int, got seed={seed!r}")
        self.configs = list(configs)
        self.seed = seed

    def propose(self, scores: Scores) -> int | None:
        """Index of the next configuration to measure, or None when all are measured."""
        raise NotImplementedError

    def _unmeasured(self, scores: Scores) -> list[int]:
        return [i for i in range(len(self.configs)) if i not in scores]


class Exhaustive(Strategy):
    """Every configuration, in enumeration order."""

    name = "exhaustive"

    def propose(self, scores: Scores) -> int | None:
        return next((i for i in range(len(self.configs)) if i not in scores), None)


class RandomSearch(Strategy):
    """Every configuration once, in an order fixed by ``seed``.

    Example:
        >>> cfgs = [{"bs": b} for b in range(10)]
        >>> RandomSearch(cfgs, seed=3).order == RandomSearch(cfgs, seed=3).order
        True
    """

    name = "random"

    def __init__(self, configs: Sequence[Mapping[str, Value]], seed: int = 0) -> None:
        super().__init__(configs, seed)
        self.order = list(range(len(self.configs)))
        random.Random(seed).shuffle(self.order)

    def propose(self, scores: Scores) -> int | None:
        return next((i for i in self.order if i not in scores), None)


class ModelGuided(Strategy):
    """Bayesian optimization over the finite space: a GP cost model, expected improvement,
    and a feasibility model that steers away from configurations likely to run out of memory.

    After ``n_init`` seeded random trials, each proposal maximizes
    ``EI(config) * P(config runs)`` over every unmeasured configuration.

    Example:
        >>> cfgs = [{"x": x, "y": y} for x in range(8) for y in range(8)]
        >>> score = lambda c: -((c["x"] - 5) ** 2) - (c["y"] - 2) ** 2
        >>> s, seen = ModelGuided(cfgs, seed=0), {}
        >>> while cfgs.index({"x": 5, "y": 2}) not in seen:
        ...     i = s.propose(seen); seen[i] = score(cfgs[i])
        >>> len(seen) <= 16
        True
    """

    name = "bayes"

    def __init__(
        self, configs: Sequence[Mapping[str, Value]], seed: int = 0, n_init: int | None = None
    ) -> None:
        super().__init__(configs, seed)
        self.x = encode(self.configs)
        n = len(self.configs)
        self.n_init = n_init if n_init is not None else max(3, min(8, math.ceil(0.02 * n)))
        self.rng = random.Random(seed)

    def propose(self, scores: Scores) -> int | None:
        todo = self._unmeasured(scores)
        if not todo:
            return None
        if len(scores) < self.n_init:
            return self.rng.choice(todo)
        seen = sorted(scores)
        ok = [i for i in seen if scores[i] is not None]
        x_todo = self.x[todo]
        if len(ok) < 2:  # no model yet: stay near what ran, away from what failed
            ok_mask = torch.tensor([scores[i] is not None for i in seen])
            acq = feasibility(x_todo, self.x[seen], ok_mask, 0.35)
        else:
            y = torch.tensor([scores[i] for i in ok], dtype=torch.float64)
            gp = GaussianProcess().fit(self.x[ok], y)
            mean, std = gp.predict(x_todo)
            acq = expected_improvement(mean, std, float(y.max()))
            if len(ok) < len(seen):
                ok_mask = torch.tensor([scores[i] is not None for i in seen])
                acq = acq * feasibility(x_todo, self.x[seen], ok_mask, gp.lengthscale)
        # Break ties at random (seeded), so equal-looking candidates are not taken in order.
        values = acq.tolist()
        ties = [self.rng.random() for _ in todo]
        best = max(range(len(todo)), key=lambda k: (values[k], ties[k]))
        return todo[best]


STRATEGIES: dict[str, Callable[..., Strategy]] = {
    Exhaustive.name: Exhaustive,
    RandomSearch.name: RandomSearch,
    ModelGuided.name: ModelGuided,
}


def make_strategy(name: str, configs: Sequence[Mapping[str, Value]], seed: int = 0) -> Strategy:
    """Build the strategy registered under ``name`` (see :data:`STRATEGIES`).

    Example:
        >>> make_strategy("random", [{"bs": 1}], seed=0).propose({})
        0
    """
    if name not in STRATEGIES:
        raise TuneValueError(f"unknown strategy={name!r}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[name](configs, seed=seed)
