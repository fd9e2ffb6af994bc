"""Keep tensor-parallel collectives whole when torch's ``pipeline()`` traces a sharded model.

Slapo's collectives (``slapo.sharding.collectives``) and the gradient hook of ``sync(mode=
"bwd_post")`` (``slapo.sharding.sync_ops``) are ``torch.autograd.Function``s. torch.export records only the aten ops of their
forward: a custom backward (the all-reduce of an input gradient, say) would be lost, and the
stage would train with wrong gradients. While tracing, :func:`opaque_collectives` swaps each of
these Functions for a shim that calls one custom op, ``slapo_pipeline::collective``, which the
trace keeps as a single node; at run time that op runs the real Function's forward, and its
registered autograd runs the real Function's backward. The expert-parallel token dispatch is kept
whole the same way (:mod:`.expert_trace`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from ..sharding import collectives, sync_ops
from .expert_trace import opaque_expert_dispatch

__all__ = ["opaque_collectives"]

# key -> (the real Function, its non-tensor arguments, the ctx its forward fills in). Traced
# graphs hold the key; the entries live as long as the process, like the stages that use them.
_CALLS: list[tuple[type, tuple, SimpleNamespace]] = []


def _fresh(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # A custom op may not return (a view of) its input.
    same = out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    return out.clone() if same else out


@torch.library.custom_op("slapo_pipeline::collective", mutates_args=())
def _collective(x: torch.Tensor, key: int) -> torch.Tensor:
    cls, args, ctx = _CALLS[key]
    return _fresh(cls.forward(ctx, x, *args), x)


@torch.library.custom_op("slapo_pipeline::collective_bwd", mutates_args=())
def _collective_bwd(grad: torch.Tensor, key: int) -> torch.Tensor:
    cls, _, ctx = _CALLS[key]
    return _fresh(cls.backward(ctx, grad)[0], grad)


def _world(args: tuple) -> int:
    return dist.get_world_size(args[0])


def _resized(x: torch.Tensor, key: int, backward: bool) -> torch.Tensor:
    """The output of a collective without running it: its shape follows from the op."""
    cls, args, _ = _CALLS[key]
    name = cls.__name__
    if name in ("_AllReduce", "_GradOp"):
        return torch.empty_like(x)
    dim = args[1] % x.dim()
    grows = (name == "_AllGather") != backward
    size = list(x.shape)
    size[dim] = size[dim] * _world(args) if grows else size[dim] // _world(args)
    return x.new_empty(size)


@_collective.register_fake
def _(x: torch.Tensor, key: int) -> torch.Tensor:
    return _resized(x, key, backward=False)


@_collective_bwd.register_fake
def _(grad: torch.Tensor, key: int) -> torch.Tensor:
    return _resized(grad, key, backward=True)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.key = inputs[1]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return torch.ops.slapo_pipeline.collective_bwd(grad, ctx.key), None


_collective.register_autograd(_backward, setup_context=_setup)


class _Shim:
    """Stands in for an autograd Function during the trace: ``apply`` calls the custom op."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def apply(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        _CALLS.append((self.cls, args, SimpleNamespace()))
        return torch.ops.slapo_pipeline.collective(x, len(_CALLS) - 1)


@contextlib.contextmanager
def opaque_collectives() -> Iterator[None]:
    """While tracing, make slapo's tensor-parallel collectives and expert-parallel dispatches
    single custom-op nodes.

    Example:
        >>> import torch
        >>> # illustration: tracing a tensor-parallel model, built on several ranks; not run here
        >>> tp_model = torch.nn.Embedding(100, 8)   # stands in for it
        >>> ids = torch.randint(0, 100, (2, 8))
        >>> with opaque_collectives():  # doctest: +SKIP
        ...     pipe = torch.distributed.pipelining.pipeline(tp_model, (ids,), {})
    """
    names = [(collectives, n) for n in ("_AllReduce", "_AllGather", "_ReduceScatter", "_Scatter")]
    names.append((sync_ops, "_GradOp"))
    saved = [(mod, n, getattr(mod, n)) for mod, n in names]
    for mod, n, cls in saved:
        setattr(mod, n, _Shim(cls))
    try:
        with opaque_expert_dispatch():
            yield
    finally:
        for mod, n, cls in saved:
            setattr(mod, n, cls)
