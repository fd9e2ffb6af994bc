"""Reference implementations used by the RoundPipe tests."""

from __future__ import annotations

import torch
from torch import nn

from roundpipe.utils import derive_seed


def mlp(n_layers: int = 4, width: int = 16, dropout: float = 0.0, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, width), nn.Tanh()]
    for _ in range(n_layers - 2):
        layers += [nn.Linear(width, width), nn.Tanh()]
        if dropout:
            layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def seeded_reference_loss(net: nn.Sequential, x: torch.Tensor, y: torch.Tensor, n_mb: int,
                          base_seed: int) -> torch.Tensor:
    """Loss of ``net`` when layer ``l`` of microbatch ``m`` draws random numbers from
    ``derive_seed(base_seed, l, m)``: what RoundPipe does with ``preserve_rng_state``."""
    total = torch.zeros(())
    for m, (xb, yb) in enumerate(zip(x.tensor_split(n_mb), y.tensor_split(n_mb))):
        h = xb
        for li, layer in enumerate(net):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(base_seed, li, m))
                h = layer(h)
        total = total + nn.functional.mse_loss(h, yb) / n_mb
    return total
