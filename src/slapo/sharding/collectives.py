"""Autograd-correct collectives for tensor parallelism (``sync_ops`` registers them as ``sync`` ops).

Each op is a ``torch.autograd.Function`` whose backward is the matching collective, with the
convention of Megatron-style tensor parallelism: the loss is computed identically on every rank of
the group, so a *replicated* activation has a replicated gradient.

==================  ===================================  ====================================
op                  forward                              backward
==================  ===================================  ====================================
``all_reduce``      sum over ranks                       identity
``all_gather``      concatenate the ranks' slices        own slice (``bwd="split"``, default)
                    along ``dim``                        or ``bwd="reduce_scatter"`` when the
                                                         consumers are tensor-parallel (SP)
``reduce_scatter``  sum, keep own slice along ``dim``    all-gather along ``dim``
``scatter``         keep own slice along ``dim``         all-gather along ``dim``
==================  ===================================  ====================================

A failing collective (a peer died, raised, or timed out) raises :class:`CollectiveError` naming
the op and the group, instead of a bare backend error.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..exceptions import SlapoError
from .groups import describe_group, resolve_group

__all__ = [
    "CollectiveError",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "scatter",
    "count_collectives",
    "gather_into",
    "run_collective",
    "scatter_into",
]

_COUNTERS: list[Counter] = []


class CollectiveError(SlapoError, RuntimeError):
    """A collective failed, usually because another rank died, raised or timed out."""


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count the communicating collectives run by these ops, keyed ``(phase, op)``.

    ``phase`` is ``"fwd"`` or ``"bwd"``; local-only steps (a split) are not counted.

    Example:
        >>> with count_collectives() as counts:
        ...     pass
        >>> counts[("fwd", "all_reduce")]
        0
    """
    counter: Counter = Counter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def _record(phase: str, op: str) -> None:
    if not _COUNTERS:
        return
    # An op called from a backward function (e.g. a bwd_post sync) runs in the backward pass.
    if torch._C._current_autograd_node() is not None:
        phase = "bwd"
    for counter in _COUNTERS:
        counter[(phase, op)] += 1


def run_collective(op: str, group: dist.ProcessGroup | None, fn: Callable[[], Any]) -> None:
    """Run ``fn`` (one collective call); a backend failure becomes a :class:`CollectiveError`
    naming ``op``, the group and this rank. The process group's timeout bounds the wait.

    Example:
        >>> t = torch.ones(2)
        >>> # needs a process group (torchrun, or slapo.env.setup): not run here
        >>> run_collective("all_reduce", None, lambda: dist.all_reduce(t))  # doctest: +SKIP
    """
    try:
        fn()
    except (RuntimeError, dist.DistBackendError) as err:
        raise CollectiveError(
            f"{op} over the tensor-parallel group {describe_group(group)} failed on global rank "
            f"{_global_rank()}: a peer rank probably died, raised an error or timed out. "
            f"Backend error: {err}"
        ) from err


def gather_into(out: torch.Tensor, x: torch.Tensor, group: Any = None) -> None:
    """``out`` = every rank's ``x``, concatenated along dim 0, over ``group``: torch's
    ``all_gather_single`` (2.13), or ``all_gather_into_tensor`` where it is missing (older
    torch; 2.13 deprecates that name).

    Example:
        >>> import slapo.env
        >>> env = slapo.env.setup()  # a world of one here
        >>> x = torch.ones(2)
        >>> out = torch.empty(2)
        >>> gather_into(out, x)
        >>> out
        tensor([1., 1.])
        >>> slapo.env.teardown()
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


def scatter_into(out: torch.Tensor, x: torch.Tensor, group: Any = None) -> None:
    """``out`` = this rank's slice (along dim 0) of ``x`` summed over ``group``: torch's
    ``reduce_scatter_single`` (2.13), or ``reduce_scatter_tensor`` where it is missing.

    Example:
        >>> import slapo.env
        >>> env = slapo.env.setup()  # a world of one here
        >>> out = torch.empty(2)
        >>> scatter_into(out, torch.ones(2))
        >>> out
        tensor([1., 1.])
        >>> slapo.env.teardown()
    """
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, x, group=group)


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else -1


def _check_divisible(t: torch.Tensor, dim: int, world: int, op: str) -> None:
    if t.shape[dim] % world != 0:
        raise SlapoError(
            f"{op}: dimension {dim} of a tensor of shape {tuple(t.shape)} has size "
            f"{t.shape[dim]}, which does not divide by the group size {world}"
        )


# ----- raw collectives (no autograd) ---------------------------------------------------------
def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, phase: str) -> torch.Tensor:
    out = t.contiguous().clone()
    _record(phase, "all_reduce")
    run_collective("all_reduce", group, lambda: dist.all_reduce(out, group=group))
    return out


def _all_gather(
    t: torch.Tensor, group: dist.ProcessGroup | None, dim: int, phase: str
) -> torch.Tensor:
    world = dist.get_world_size(group)
    front = t.movedim(dim, 0).contiguous()
    out = front.new_empty((world * front.shape[0], *front.shape[1:]))
    _record(phase, "all_gather")
    run_collective("all_gather", group, lambda: gather_into(out, front, group))
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(
    t: torch.Tensor, group: dist.ProcessGroup | None, dim: int, phase: str
) -> torch.Tensor:
    world = dist.get_world_size(group)
    _check_divisible(t, dim, world, "reduce_scatter")
    front = t.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    _record(phase, "reduce_scatter")
    run_collective("reduce_scatter", group, lambda: scatter_into(out, front, group))
    return out.movedim(0, dim).contiguous()


def _split(t: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    _check_divisible(t, dim, world, "split")
    return t.chunk(world, dim)[dist.get_rank(group)].contiguous()


# ----- autograd functions --------------------------------------------------------------------
class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(t, group, "fwd")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, dim: int, bwd: str) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.bwd = group, dim, bwd
        return _all_gather(t, group, dim, "fwd")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.bwd == "reduce_scatter":
            return _reduce_scatter(grad, ctx.group, ctx.dim, "bwd"), None, None, None
        return _split(grad, ctx.group, ctx.dim), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(t, group, dim, "fwd")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _all_gather(grad, ctx.group, ctx.dim, "bwd"), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(t, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _all_gather(grad, ctx.group, ctx.dim, "bwd"), None, None


# ----- public ops (the signature sync expects: op(tensor, group=..., **kwargs)) ------------------
def all_reduce(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum ``tensor`` over the group; the gradient passes through unchanged.

    Example (in a 2-rank job):
        >>> y = all_reduce(torch.ones(2))  # tensor([2., 2.]) on both ranks  # doctest: +SKIP
    """
    return _AllReduce.apply(tensor, resolve_group(group))


def all_gather(
    tensor: torch.Tensor, group: Any = None, dim: int = -1, bwd: str = "split"
) -> torch.Tensor:
    """Concatenate the ranks' ``tensor`` along ``dim``.

    ``bwd="split"`` (default) keeps this rank's slice of a replicated gradient;
    ``bwd="reduce_scatter"`` sums partial gradients first, as sequence parallelism needs in front of
    a column-parallel layer.

    Example (in a 2-rank job):
        >>> y = all_gather(torch.ones(2, 3), dim=0)  # shape (4, 3)  # doctest: +SKIP
    """
    if bwd not in ("split", "reduce_scatter"):
        raise SlapoError(f'all_gather: bwd must be "split" or "reduce_scatter", got {bwd!r}')
    return _AllGather.apply(tensor, resolve_group(group), dim, bwd)


def reduce_scatter(tensor: torch.Tensor, group: Any = None, dim: int = -1) -> torch.Tensor:
    """Sum over the group and keep this rank's slice along ``dim``; backward all-gathers.

    Example (in a 2-rank job):
        >>> y = reduce_scatter(torch.ones(4, 3), dim=0)  # shape (2, 3), all 2.0  # doctest: +SKIP
    """
    return _ReduceScatter.apply(tensor, resolve_group(group), dim)


def scatter(tensor: torch.Tensor, group: Any = None, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice of a replicated ``tensor`` along ``dim``; backward all-gathers.

    Example (in a 2-rank job):
        >>> y = scatter(torch.arange(4.0), dim=0)  # rank 0: tensor([0., 1.])  # doctest: +SKIP
    """
    return _Scatter.apply(tensor, resolve_group(group), dim)
