"""Data parallelism across pipeline replicas: the gradient sums a pipeline step makes after its
schedule ran, and the global gradient norm over every dimension of a ``("dp", "pp", "tp")`` mesh.

A pipeline step's gradients are finished in three passes over this rank's stage parameters:
tied copies summed over the stages holding them (:class:`~slapo.pipeline.TiedGradSync`), then
averaged over the data-parallel replicas (:class:`ReplicaGradAverage`). Both act on the gradient
of *this* step only: :class:`FreshGrads` sets the accumulated gradients aside before the schedule
runs and adds them back after, so that accumulating over several steps (no ``zero_grad`` in
between) sums each step's finished gradient once, as DDP does.

Example:
    >>> # illustration: one step of a pipeline rank with data-parallel replicas, as the
    >>> # engine of slapo.targets.pipeline runs it under torchrun; not run here
    >>> import torch
    >>> model = torch.nn.Linear(4, 4)
    >>> params = list(model.parameters())
    >>> dp_group = torch.distributed.new_group()  # doctest: +SKIP
    >>> with FreshGrads(params):  # doctest: +SKIP
    ...     model(torch.ones(2, 4)).sum().backward()   # the pipeline schedule's step
    ...     ReplicaGradAverage(dp_group)(params)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["FreshGrads", "ReplicaGradAverage", "global_grad_norm", "local_part"]

#: Bytes all-reduced at once: large enough to amortise a collective's latency, small enough not
#: to double the gradient memory (DDP's default bucket is 25 MiB).
BUCKET_BYTES = 25 * 2**20


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (an FSDP2 replica's shard), else ``t`` itself.

    Example:
        >>> local_part(torch.ones(2)).shape
        torch.Size([2])
    """
    return t.to_local() if hasattr(t, "to_local") else t


class FreshGrads:
    """Set the parameters' accumulated gradients aside for a block; add them back after it.

    Inside the block the parameters hold only what the block's backward produced, which the
    pipeline's gradient passes may then sum over ranks without summing older steps again.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> params = list(model.parameters())
        >>> model(torch.ones(1, 2)).sum().backward()     # an earlier step's gradient
        >>> with FreshGrads(params):
        ...     model(torch.ones(1, 2)).sum().backward()
        ...     print(model.bias.grad)   # this backward's gradient only (reduce it here)
        tensor([1.])
        >>> model.bias.grad     # both steps again after the block
        tensor([2.])
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self._kept: list[torch.Tensor | None] = []

    def __enter__(self) -> FreshGrads:
        self._kept = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return self

    def __exit__(self, *exc: Any) -> None:
        for p, old in zip(self.params, self._kept):
            if old is None:
                continue
            p.grad = old if p.grad is None else old.add_(p.grad)
        self._kept = []


class ReplicaGradAverage:
    """Average gradients over the data-parallel replicas of a pipeline (DDP's all-reduce).

    Gradients are flattened into buckets of :data:`BUCKET_BYTES` per dtype and all-reduced over
    ``group``; every replica holds the same parameters in the same order (the same stage of the
    same model), so the buckets line up. A parameter without a gradient on this step has none on
    any replica (the replicas run the same graph) and is skipped.

    Example:
        >>> import slapo
        >>> # illustration: each rank of a 4-rank job (torchrun) with dp=2; not run here
        >>> mesh = slapo.sharding.init_parallel_mesh("cpu", dp=2, tp=2)  # doctest: +SKIP
        >>> model = torch.nn.Linear(4, 4)
        >>> ReplicaGradAverage(mesh["dp"].get_group())(model.parameters())  # doctest: +SKIP
    """

    def __init__(self, group: dist.ProcessGroup, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.bucket_bytes = bucket_bytes

    def __call__(self, params: Iterable[nn.Parameter]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        for bucket in _buckets(grads, self.bucket_bytes):
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.size)
            for grad, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                grad.copy_(reduced)


def _buckets(grads: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    by_dtype: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for g in grads:
        runs = by_dtype.setdefault(g.dtype, [[]])
        if runs[-1] and sum(t.numel() * t.element_size() for t in runs[-1]) >= limit:
            runs.append([])
        runs[-1].append(g)
    return [b for runs in by_dtype.values() for b in runs if b]


def global_grad_norm(
    counted: Sequence[torch.Tensor], groups: Sequence[dist.ProcessGroup | None]
) -> torch.Tensor:
    """The 2-norm of the whole model's gradient from each rank's ``counted`` gradients.

    ``counted`` are this rank's gradients that no other rank in ``groups`` counts (a slice of a
    tensor-parallel weight on every rank; a replicated weight on one rank of its group; a tied
    weight on one of its stages); their squared sums are added over each group of ``groups``.

    Example:
        >>> global_grad_norm([torch.full((2,), 3.0), torch.full((1,), 4.0)], [None])  # one rank
        tensor(5.8310, dtype=torch.float64)
        >>> # illustration: on each rank of a 4-rank pipeline x tensor-parallel job; not run here
        >>> import slapo
        >>> mesh = slapo.sharding.init_parallel_mesh("cpu", pp=2, tp=2)  # doctest: +SKIP
        >>> pp_group, tp_group = mesh["pp"].get_group(), mesh["tp"].get_group()  # doctest: +SKIP
        >>> mine = [torch.ones(2)]    # this rank's counted gradients
        >>> global_grad_norm(mine, [pp_group, tp_group])  # doctest: +SKIP
        tensor(2.)
    """
    device = counted[0].device if counted else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in counted:
        total += g.detach().double().pow(2).sum()
    for group in groups:
        if group is not None:
            dist.all_reduce(total, group=group)
    return total.sqrt()
