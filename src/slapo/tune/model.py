"""A small cost model over a finite tuning space: a Gaussian process plus a feasibility model.

Dependency-free beyond torch (already a Slapo dependency). Configurations are encoded as
vectors: numeric knobs by their rank among the candidates (batch sizes 1, 2, 4, 8 sit evenly
spaced), categorical knobs one-hot, and a knob missing from a configuration (a dependent
symbol) by an "absent" indicator.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import torch

from .space import Value


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def encode(configs: Sequence[Mapping[str, Value]]) -> torch.Tensor:
    """Encode configurations as rows of a float64 matrix, features roughly in [0, 1].

    Example:
        >>> encode([{"bs": 1, "fuse": True}, {"bs": 4, "fuse": False}]).round(decimals=3).tolist()
        [[0.0, 0.707, 0.0], [1.0, 0.0, 0.707]]
    """
    values: dict[str, dict[str, Value]] = {}  # name -> {JSON of value: value}, in order seen
    for cfg in configs:
        for name, val in cfg.items():
            values.setdefault(name, {}).setdefault(json.dumps(val), val)
    columns: list[list[float]] = []
    for name, seen in values.items():
        vals = list(seen.values())
        absent = [name not in cfg for cfg in configs]
        if all(_is_number(v) for v in vals):
            if len(vals) > 1:
                order = sorted(vals)  # type: ignore[type-var]
                rank = {v: i / (len(order) - 1) for i, v in enumerate(order)}
                columns.append([0.0 if a else rank[cfg[name]] for cfg, a in zip(configs, absent)])
        elif len(vals) > 1:
            # Scaled so that two different categories are at distance 1, like the rank extremes.
            w = 1.0 / math.sqrt(2.0)
            for v in vals:
                columns.append(
                    [
                        w if (not a and _same(cfg[name], v)) else 0.0
                        for cfg, a in zip(configs, absent)
                    ]
                )
        if any(absent) and not all(absent):
            columns.append([1.0 if a else 0.0 for a in absent])
    if not columns:
        return torch.zeros(len(configs), 1, dtype=torch.float64)
    return torch.tensor(columns, dtype=torch.float64).T.contiguous()


def _same(a: Value, b: Value) -> bool:
    return a == b and type(a) is type(b)


def matern52(a: torch.Tensor, b: torch.Tensor, lengthscale: float) -> torch.Tensor:
    """Matern 5/2 kernel matrix between the rows of ``a`` and ``b``."""
    d = torch.cdist(a, b) / lengthscale
    s = math.sqrt(5.0) * d
    return (1.0 + s + s * s / 3.0) * torch.exp(-s)


class GaussianProcess:
    """A zero-mean GP on standardized targets; hyperparameters picked by marginal likelihood.

    Example:
        >>> x = torch.tensor([[0.0], [0.5], [1.0]], dtype=torch.float64)
        >>> gp = GaussianProcess().fit(x, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
        >>> mean, std = gp.predict(torch.tensor([[0.5]], dtype=torch.float64))
        >>> round(float(mean[0]), 1)
        1.0
    """

    LENGTHSCALES = (0.1, 0.2, 0.35, 0.6, 1.0, 1.7)
    NOISES = (1e-4, 1e-2, 1e-1)

    def __init__(self) -> None:
        self.lengthscale = 0.5
        self.noise = 1e-2

    def fit(self, x: torch.Tensor, y: torch.Tensor) -> GaussianProcess:
        """Fit to inputs ``x`` (n x d) and targets ``y`` (n)."""
        self.x = x
        self.y_mean = float(y.mean())
        self.y_std = float(y.std()) if len(y) > 1 and float(y.std()) > 0 else 1.0
        self.y = (y - self.y_mean) / self.y_std
        best = -math.inf
        for ls in self.LENGTHSCALES:
            for noise in self.NOISES:
                lml = self._log_marginal_likelihood(ls, noise)
                if lml > best:
                    best, self.lengthscale, self.noise = lml, ls, noise
        k = matern52(x, x, self.lengthscale) + self.noise * torch.eye(len(x), dtype=x.dtype)
        self.chol = torch.linalg.cholesky(k)
        self.alpha = torch.cholesky_solve(self.y[:, None], self.chol)[:, 0]
        return self

    def _log_marginal_likelihood(self, ls: float, noise: float) -> float:
        n = len(self.x)
        k = matern52(self.x, self.x, ls) + noise * torch.eye(n, dtype=self.x.dtype)
        chol, info = torch.linalg.cholesky_ex(k)
        if int(info) != 0:
            return -math.inf
        alpha = torch.cholesky_solve(self.y[:, None], chol)[:, 0]
        return float(-0.5 * self.y @ alpha - torch.log(torch.diagonal(chol)).sum())

    def predict(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior mean and standard deviation at ``x``, in the original units."""
        ks = matern52(x, self.x, self.lengthscale)
        mean = ks @ self.alpha
        v = torch.cholesky_solve(ks.T, self.chol)
        var = (1.0 - (ks * v.T).sum(dim=1)).clamp_min(1e-12)
        return mean * self.y_std + self.y_mean, var.sqrt() * self.y_std


def expected_improvement(
    mean: torch.Tensor, std: torch.Tensor, best: float, xi: float = 0.0
) -> torch.Tensor:
    """Expected amount by which each prediction beats ``best`` (maximization)."""
    gain = mean - best - xi
    z = gain / std
    normal = torch.distributions.Normal(0.0, 1.0)
    return gain * normal.cdf(z) + std * torch.exp(normal.log_prob(z))


def feasibility(
    x: torch.Tensor, x_seen: torch.Tensor, ok: torch.Tensor, lengthscale: float
) -> torch.Tensor:
    """Probability that each row of ``x`` runs (no OOM, no crash), from nearby outcomes.

    A kernel-weighted vote of the measured neighbours, shrunk toward the overall success
    rate where no neighbour is close.
    """
    prior = (float(ok.sum()) + 1.0) / (len(ok) + 2.0)
    w = matern52(x, x_seen, lengthscale)
    return (w @ ok.to(x.dtype) + prior) / (w.sum(dim=1) + 1.0)
