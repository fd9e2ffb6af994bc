"""Stand-ins for the ops of a training step that cannot run on fake tensors, for the fake step.

:func:`slapo.estimate_memory` runs the step on fake tensors (shapes, no values). Two parts of a
mixture-of-experts model read values or lack a fake kernel, and run in the fake step as a
stand-in that allocates what the real op allocates:

* transformers' fused experts (``@use_experts_implementation``: Qwen3-MoE, Mixtral, ...) call
  ``torch._grouped_mm``, whose shape check (its fake kernel) accepts bf16 inputs only: the fake
  step runs transformers' own fallback op instead (``transformers::grouped_mm_fallback``: the same
  output and saved tensors, with a fake kernel of its own);
* older transformers (e.g. 5.15) run that fallback's backward as a Python loop over the routing's
  offsets (``tolist``): the fake step runs each experts module of a
  layout slapo knows (:data:`slapo.sharding.expert_parallel.LAYOUTS`) on evenly routed rows
  instead, expert by expert, as the loop does;
* the expert-parallel dispatch (:func:`slapo.sharding.expert_dispatch.dispatch_combine`) sizes its
  all-to-all by the routing (``bincount``, ``tolist``): the fake step routes evenly instead, every
  rank sending and receiving ``tokens * top_k / ep`` rows to and from each rank and each local
  expert getting an equal share, the expected count when the router balances its load (what its
  auxiliary loss trains it to do). A skewed router sends more rows to some rank than this.

Example:
    >>> with fake_step_stand_ins():
    ...     pass        # the fake step runs here
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "balanced_dispatch_combine",
    "balanced_local_experts",
    "even_splits",
    "fake_step_stand_ins",
]


def even_splits(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` sizes that differ by at most one (the larger first).

    Example:
        >>> even_splits(10, 4)
        [3, 3, 2, 2]
    """
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def balanced_dispatch_combine(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    expert_fn: Callable[[int, torch.Tensor], torch.Tensor],
    group: Any = None,
) -> torch.Tensor:
    """:func:`~slapo.sharding.expert_dispatch.dispatch_combine` with evenly routed rows: the same
    tensors and collectives, sized without reading the routing (see the module doc).

    Example (a real group of one rank: the result is the real dispatch's):
        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> x, ids, w = torch.ones(3, 2), torch.tensor([[0, 1]] * 3), torch.full((3, 2), 0.5)
        >>> balanced_dispatch_combine(x, ids, w, 2, lambda j, rows: rows * (j + 1)).tolist()
        [[1.5, 1.5], [1.5, 1.5], [1.5, 1.5]]
        >>> dist.destroy_process_group()
    """
    import torch.distributed as dist

    from ..sharding.expert_dispatch import all_to_all_rows

    ep = dist.get_world_size(group)
    per_rank = num_experts // ep
    tokens, top_k = expert_ids.shape
    order = torch.argsort(expert_ids.reshape(-1), stable=True)
    token_of = torch.arange(tokens, device=hidden.device).repeat_interleave(top_k)[order]
    splits = even_splits(tokens * top_k, ep)  # sent to each rank, and received from each
    arrived = all_to_all_rows(hidden[token_of], splits, splits, group)
    # the real dispatch sorts what arrived by local expert: a permutation of the rows
    by_expert = torch.argsort(torch.arange(arrived.shape[0], device=hidden.device), stable=True)
    chunks = torch.split(arrived[by_expert], even_splits(arrived.shape[0], per_rank))
    outputs = torch.cat([expert_fn(j, rows) for j, rows in enumerate(chunks)])
    results = torch.empty_like(outputs).index_copy(0, by_expert, outputs)
    returned = all_to_all_rows(results, splits, splits, group)
    weighted = returned * weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden).index_add(0, token_of, weighted.to(hidden.dtype))


def balanced_local_experts(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    expert_fn: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The experts of one process on evenly routed rows: each expert gets an equal share of the
    ``tokens * top_k`` (token, expert) pairs, gathered, run and added back weighted, as a loop over
    the experts does (see the module doc).

    Example:
        >>> x, ids, w = torch.ones(3, 2), torch.tensor([[0, 1]] * 3), torch.full((3, 2), 0.5)
        >>> balanced_local_experts(x, ids, w, 2, lambda j, rows: rows * (j + 1)).tolist()
        [[1.5, 1.5], [1.5, 1.5], [1.5, 1.5]]
    """
    tokens, top_k = expert_ids.shape
    order = torch.argsort(expert_ids.reshape(-1), stable=True)
    token_of = torch.arange(tokens, device=hidden.device).repeat_interleave(top_k)[order]
    chunks = torch.split(token_of, even_splits(tokens * top_k, num_experts))
    flat_weights = weights.reshape(-1)[order]
    out = torch.zeros_like(hidden)
    start = 0
    for j, rows in enumerate(chunks):
        w = flat_weights[start : start + rows.shape[0], None]
        out = out.index_add(0, rows, (expert_fn(j, hidden[rows]) * w).to(hidden.dtype))
        start += rows.shape[0]
    return out


def _looped_experts_forward(module: Any) -> Callable[..., torch.Tensor]:
    from ..sharding.expert_parallel import LAYOUTS

    layout = LAYOUTS[type(module).__name__]

    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return balanced_local_experts(
            hidden, top_k_index, top_k_weights, module.num_experts,
            lambda j, rows: layout.expert(module, j, rows),
        )  # fmt: skip

    return forward


@contextlib.contextmanager
def _looped_experts(model: Any) -> Iterator[None]:
    """Each experts module of ``model`` with a known layout runs :func:`balanced_local_experts`."""
    from ..sharding.expert_parallel import LAYOUTS

    modules = [m for m in model.modules() if type(m).__name__ in LAYOUTS]
    for m in modules:
        m.forward = _looped_experts_forward(m)
    try:
        yield
    finally:
        for m in modules:
            del m.forward  # back to the class's


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def fake_step_stand_ins(model: Any = None) -> Iterator[None]:
    """Run the fake step (of ``model``) with the stand-ins of the module doc (each only where its
    module is importable: transformers' MoE integration, slapo's expert parallelism)."""
    with contextlib.ExitStack() as ctx:
        try:
            from transformers.integrations import moe
        except ImportError:  # an older transformers: no fused experts
            moe = None
        # the fallback's backward runs on fakes where it is an op of its own (transformers 5.2x);
        # before, it loops over the routing's offsets in Python (5.15)
        fallback_runs = hasattr(moe, "_grouped_mm_fallback_backward_fake")
        if moe is not None and hasattr(moe, "_can_use_grouped_mm") and fallback_runs:
            ctx.enter_context(_patched(moe, "_can_use_grouped_mm", lambda *_a, **_k: False))
        elif model is not None:  # experts looped over in Python: evenly routed rows
            ctx.enter_context(_looped_experts(model))
        # the module (the package's attribute of that name is the function)
        experts = importlib.import_module("slapo.sharding.expert_parallel")
        ctx.enter_context(_patched(experts, "dispatch_combine", balanced_dispatch_combine))
        yield
