"""The oracle of the user-guide tests (``tests/roundpipe/test_guide_*.py``): RoundPipe's
training loop written in plain PyTorch, and small helpers the guide pages share.

:class:`PlainTrainer` is what ``forward_backward`` + ``model.step`` compute: the batch split
into microbatches along dim 0 (``tensor_split``), ``loss_fn`` called and back-propagated per
microbatch, the returned loss the sum; gradients handed to optimizer copies in ``optim_dtype``,
the step taken there and written back into the model's parameters (cast to the model's dtype).
With ``is_async=True`` iteration ``k`` runs on the values after step ``k - 2`` (one step stale,
``model.step(is_async=True)``), or the latest ones right after ``model.synchronize()``
(:meth:`PlainTrainer.synchronized`); otherwise always on the latest ones.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

import roundpipe

MakeOpt = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def split_mb(value: Any, n: int) -> list[Any]:
    """``value`` split into ``n`` microbatches as RoundPipe's default split does for even batches:
    tensors along dim 0, dicts and tuples per entry, anything else repeated."""
    if isinstance(value, torch.Tensor):
        return list(value.tensor_split(n))
    if isinstance(value, dict):
        parts = {k: split_mb(v, n) for k, v in value.items()}
        return [{k: parts[k][i] for k in value} for i in range(n)]
    if isinstance(value, tuple):
        parts_t = [split_mb(v, n) for v in value]
        return [tuple(p[i] for p in parts_t) for i in range(n)]
    return [value] * n


class PlainTrainer:
    """RoundPipe's training in plain PyTorch (see the module docstring).

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 1))
        >>> ref = PlainTrainer(net, lambda ps: torch.optim.SGD(ps, lr=0.1), is_async=False)
        >>> loss = ref.forward_backward((torch.ones(4, 4),), {}, torch.zeros(4, 1),
        ...                             lambda out, y: (out - y).pow(2).mean(), 2)
        >>> ref.step()
    """

    def __init__(
        self,
        net: nn.Module,
        make_opt: MakeOpt,
        optim_dtype: torch.dtype | None = None,
        is_async: bool = True,
    ) -> None:
        self.model = copy.deepcopy(net)
        self.master = [
            nn.Parameter(p.detach().to(optim_dtype or p.dtype, copy=True))
            for p in self.model.parameters()
        ]
        self.opt = make_opt(self.master)
        self.is_async = is_async
        self.snapshots: list[list[torch.Tensor]] = []  # optimizer values after each step
        self.iterations = 0
        self.synced = -1  # the last step synchronize() waited for

    def _load_values(self) -> None:
        """Write into the model the values this iteration runs on."""
        j = max(self.iterations - (2 if self.is_async else 1), self.synced)
        if j < 0:
            return
        with torch.no_grad():
            for p, v in zip(self.model.parameters(), self.snapshots[j]):
                p.copy_(v)

    def forward_backward(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        label: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        num_microbatch: int,
        outputs: list[Any] | None = None,
    ) -> torch.Tensor:
        """One ``forward_backward`` call: the summed loss (``outputs`` collects the outputs)."""
        self._load_values()
        total = torch.zeros(())
        parts = zip(
            split_mb(args, num_microbatch),
            split_mb(kwargs, num_microbatch),
            split_mb(label, num_microbatch),
        )
        for a, k, y in parts:
            out = self.model(*a, **k)
            loss = loss_fn(out, y)
            loss.backward()
            total = total + loss.detach().float()
            if outputs is not None:
                outputs.append(out.detach() if isinstance(out, torch.Tensor) else out)
        return total

    def step(self, step_fn: Callable[[torch.optim.Optimizer], Any] | None = None) -> None:
        """One ``model.step``: gradients to the optimizer copies, ``step_fn(opt)`` (default
        ``opt.step(); opt.zero_grad()``), the new values kept for the iterations to come."""
        for p, m in zip(self.model.parameters(), self.master):
            m.grad = None if p.grad is None else p.grad.to(m.dtype)
            p.grad = None
        if step_fn is None:
            self.opt.step()
            self.opt.zero_grad()
        else:
            step_fn(self.opt)
        self.snapshots.append([m.detach().clone() for m in self.master])
        self.iterations += 1

    def synchronized(self) -> nn.Module:
        """The model holding the latest optimizer values (``model.synchronize()``: the next
        iteration runs on them too)."""
        self.synced = len(self.snapshots) - 1
        if self.snapshots:
            with torch.no_grad():
                for p, v in zip(self.model.parameters(), self.snapshots[-1]):
                    p.copy_(v)
        return self.model


def assert_params(
    got: Iterable[torch.Tensor],
    want: Iterable[torch.Tensor],
    what: str,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Every tensor of ``got`` equals the one at the same position in ``want``."""
    got, want = list(got), list(want)
    assert len(got) == len(want), f"{what}: {len(got)} tensors, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(
            a.detach(), b.detach(), rtol=rtol, atol=atol, msg=lambda m, i=i: f"{what} [{i}]: {m}"
        )


def assert_grads(
    got: nn.Module, want: nn.Module, what: str, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Every parameter gradient of ``got`` equals ``want``'s (both present or both absent)."""
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what}: {name} grad presence"
        if p.grad is not None:
            torch.testing.assert_close(
                p.grad, q.grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}"
            )


def wrap(net: nn.Module, num_microbatch: int | None = None, **kwargs: Any) -> roundpipe.RoundPipe:
    """``RoundPipe(net, ...)`` with a model-level ``num_microbatch`` (None: the default)."""
    cfg = roundpipe.RoundPipeRunConfig(num_microbatch=num_microbatch)
    kwargs.setdefault("pin_model", "off")
    return roundpipe.RoundPipe(net, model_run_config=cfg, **kwargs)


def batches(n: int, shape: Sequence[int], out_dim: int, seed: int) -> list[tuple[Any, Any]]:
    """``n`` synthetic (input, regression target) batches: the guide's ``dataloader``."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(*shape, generator=g), torch.randn(shape[0], out_dim, generator=g))
        for _ in range(n)
    ]
