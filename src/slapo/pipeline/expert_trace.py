"""Keep the expert-parallel token dispatch whole when torch's ``pipeline()`` traces a model.

An :class:`~slapo.sharding.expert_parallel.ExpertParallelExperts` forward calls
:func:`~slapo.sharding.expert_dispatch.dispatch_combine`: all-to-alls whose split sizes depend on
the routing (data-dependent shapes torch.export cannot trace), and autograd Functions whose
backward (the inverse exchange) a trace would drop. While tracing, :func:`opaque_expert_dispatch`
swaps the name ``dispatch_combine`` in :mod:`slapo.sharding.expert_parallel` for a shim that
records one custom op, ``slapo_pipeline::expert_dispatch``, taking the experts module's
parameters as inputs. At run time the op runs the real dispatch with the module's expert math
on the parameters the stage passes it; its backward recomputes that forward under autograd and
returns the gradients of the tokens, the routing weights and every expert parameter. The
recompute costs one more dispatch (three all-to-alls and the local experts' forward) per MoE layer
and microbatch backward: the op's kernel runs below autograd, so the graph of its forward is not
kept (see ``_backward``).

Collective order: every rank of the expert-parallel group must issue the all-to-alls in the same
order. The group's ranks hold the same pipeline stage (of different pipeline replicas) and run
the same schedule on the same traced graph, so their forwards and backwards (recompute included)
line up microbatch by microbatch and layer by layer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..exceptions import TargetError
from ..sharding import expert_dispatch
from ..sharding import expert_parallel as _ep_module

__all__ = ["opaque_expert_dispatch"]


@dataclass(frozen=True)
class _Experts:
    """What the op needs of one traced experts module besides its parameter tensors."""

    expert: Callable[..., torch.Tensor]  # the module's expert method, unbound: (self, j, rows)
    attrs: dict[str, Any]  # the module's plain attributes and child modules (act_fn, layout...)
    params: tuple[str, ...]  # its own parameters' names, in the order the op receives them
    num_experts: int
    group: dist.ProcessGroup | None


# key -> the experts module a traced op node runs. Graphs hold the key; the entries live as long
# as the process, like the stages that use them (as tp_trace's registry).
_EXPERTS: list[_Experts] = []


def _register(expert_fn: Callable, num_experts: int, group: dist.ProcessGroup | None) -> int:
    module = getattr(expert_fn, "__self__", None)
    if not isinstance(module, nn.Module):
        raise TargetError(
            "pipeline: an expert-parallel dispatch_combine was traced with expert_fn="
            f"{expert_fn!r}, not a method of the experts module; the pipeline target can only "
            "trace the dispatch of slapo.sharding.expert_parallel.ExpertParallelExperts "
            "(apply expert_parallel(model, group) before slapo.build)"
        )
    attrs = {k: v for k, v in vars(module).items() if not k.startswith("_")}
    attrs.update(module.named_children())
    names = tuple(n for n, _ in module.named_parameters(recurse=False))
    _EXPERTS.append(_Experts(expert_fn.__func__, attrs, names, num_experts, group))  # type: ignore[attr-defined]
    return len(_EXPERTS) - 1


def _dispatch(
    key: int,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    params: list[torch.Tensor],
) -> torch.Tensor:
    """The real dispatch, with the expert math applied to ``params`` (the stage's tensors, not
    the traced module's): a light view stands in for the module as ``self``."""
    rec = _EXPERTS[key]
    view = SimpleNamespace(**rec.attrs, **dict(zip(rec.params, params)))
    expert_fn = functools.partial(rec.expert, view)
    return expert_dispatch.dispatch_combine(
        hidden, top_k_index, top_k_weights, rec.num_experts, expert_fn, rec.group
    )


@torch.library.custom_op("slapo_pipeline::expert_dispatch", mutates_args=())
def _expert_dispatch(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    params: list[torch.Tensor],
    key: int,
) -> torch.Tensor:
    return _dispatch(key, hidden, top_k_index, top_k_weights, params)


@_expert_dispatch.register_fake
def _(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    params: list[torch.Tensor],
    key: int,
) -> torch.Tensor:
    return torch.empty_like(hidden)  # the combine returns one row per token, like hidden


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    hidden, top_k_index, top_k_weights, params, key = inputs
    ctx.save_for_backward(hidden, top_k_index, top_k_weights, *params)
    ctx.key = key


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """Recompute the dispatch under autograd and differentiate it.

    The op's kernel runs below autograd: the graph ``dispatch_combine`` builds (its all-to-all
    Functions, the expert matmuls) is not kept, and one traced node serves every microbatch (a
    1F1B schedule has several in flight), so there is no per-call graph to reuse. Rebuilding it
    from the saved inputs costs one more dispatch (its three all-to-alls) per MoE layer and
    microbatch backward, and keeps no expert activations between forward and backward. The
    routing is saved, so the recompute's split sizes are the forward's. Every input is made to
    require grad so every rank runs the same inverse exchanges, whatever its stage needs.
    """
    hidden, top_k_index, top_k_weights, *params = ctx.saved_tensors
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (hidden, top_k_weights, *params)]
        h, w, *ps = inputs
        out = _dispatch(ctx.key, h, top_k_index, w, ps)
    grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]
    return grads[0], None, grads[1], grads[2:], None


_expert_dispatch.register_autograd(_backward, setup_context=_setup)


def _shim(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    expert_fn: Callable,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``dispatch_combine``'s signature; records one op node taking the module's parameters."""
    key = _register(expert_fn, num_experts, group)
    module = expert_fn.__self__  # type: ignore[attr-defined]
    params = [getattr(module, n) for n in _EXPERTS[key].params]  # the traced tensors
    return torch.ops.slapo_pipeline.expert_dispatch(hidden, expert_ids, weights, params, key)


@contextlib.contextmanager
def opaque_expert_dispatch() -> Iterator[None]:
    """While tracing, make each expert-parallel dispatch one ``slapo_pipeline::expert_dispatch``
    node (restored on exit).

    Example:
        >>> import torch
        >>> # illustration: tracing an expert-parallel model, built on several ranks; not run here
        >>> ep_model = torch.nn.Embedding(100, 8)   # stands in for it
        >>> ids = torch.randint(0, 100, (2, 8))
        >>> with opaque_expert_dispatch():  # doctest: +SKIP
        ...     pipe = torch.distributed.pipelining.pipeline(ep_model, (ids,), {})
    """
    saved = _ep_module.dispatch_combine
    _ep_module.dispatch_combine = _shim
    try:
        yield
    finally:
        _ep_module.dispatch_combine = saved
