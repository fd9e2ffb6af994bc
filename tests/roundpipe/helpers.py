"""Reference implementations used by the RoundPipe tests."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from roundpipe.runtime.rng import derive_seed


def mlp(n_layers: int = 4, width: int = 16, dropout: float = 0.0, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, width), nn.Tanh()]
    for _ in range(n_layers - 2):
        layers += [nn.Linear(width, width), nn.Tanh()]
        if dropout:
            layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


class DoublesInPlace(nn.Module):
    """A Linear whose no-grad forward doubles its input in place and halves it again in its
    arithmetic: the same output, but a host copy sharing the input's memory would be corrupted
    for the recompute."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return torch.tanh(self.lin(x))
        x.mul_(2.0)
        return torch.tanh(self.lin(x / 2.0))


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def seeded_reference_loss(
    net: nn.Sequential, x: torch.Tensor, y: torch.Tensor, n_mb: int, base_seed: int
) -> torch.Tensor:
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


def delayed_update_reference(
    net0: nn.Module,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    make_opt: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    make_sched: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> tuple[list[torch.Tensor], nn.Module, torch.optim.Optimizer]:
    """RoundPipe's asynchronous training in plain PyTorch: iteration ``k`` runs forward and
    backward on the optimizer's values after step ``k - 2`` (one step stale) and step ``k``
    applies that gradient to the latest values. The loss is the MSE over the batch.

    Returns the per-iteration losses, the final (up-to-date) model and its optimizer;
    ``make_sched(opt)`` makes an lr scheduler stepped after every optimizer step.
    """
    used = copy.deepcopy(net0)  # the weights the iteration runs on
    master = copy.deepcopy(net0)  # the optimizer's weights
    opt = make_opt(master.parameters())
    sched = make_sched(opt) if make_sched is not None else None
    snapshots, losses = [], []
    for k, (x, y) in enumerate(data):
        if k >= 2:
            used.load_state_dict(snapshots[k - 2])
        loss = nn.functional.mse_loss(used(x), y)
        loss.backward()
        for p, q in zip(master.parameters(), used.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        opt.zero_grad()
        used.zero_grad()
        if sched is not None:
            sched.step()
        snapshots.append(copy.deepcopy(master.state_dict()))
        losses.append(loss.detach())
    return losses, master, opt


def tiny_qwen3(**overrides: Any) -> nn.Module:
    """A 2-layer random-weight Qwen3 causal LM (seed 0; GQA: 4 query, 2 key/value heads);
    ``overrides``: config fields (``use_cache=False``, token ids). Skips without transformers."""
    import pytest

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        **overrides,
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(cfg)
