"""All-to-all token dispatch for expert parallelism (EP), correct under autograd.

``E`` experts are split evenly over the ``ep`` ranks of a process group: rank ``r`` owns experts
``[r * E / ep, (r + 1) * E / ep)``. :func:`dispatch_combine` sends every (token, chosen expert)
pair to the rank owning that expert, runs the local experts on what arrived, sends the results
back and sums them with the routing weights in the original token order:

1. the per-expert counts are exchanged (``all_to_all_single`` of ints), so each rank knows how many
   rows it receives from every peer and for which of its local experts;
2. the rows are exchanged (``all_to_all_single`` with those split sizes);
3. the local experts run; the results travel the reverse way.

The row exchanges are :class:`_AllToAll` autograd functions whose backward is the inverse
exchange, so gradients reach both the tokens and the local experts' weights. Every rank must call
:func:`dispatch_combine` the same number of times in the same order (as for any collective).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from .collectives import CollectiveError
from .groups import describe_group

__all__ = ["all_to_all_rows", "count_dispatched", "dispatch_combine"]

ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]
_COUNTERS: list[Counter] = []


@contextlib.contextmanager
def count_dispatched() -> Iterator[Counter]:
    """Count what :func:`dispatch_combine` sends in its forward token exchange.

    Keys: ``"rows_to_peers"`` (token rows sent to *other* ranks), ``"elements_to_peers"`` (their
    element count), ``"bytes_to_peers"`` (their size in bytes: elements x the hidden states'
    element size), ``"rows_kept"`` (rows routed to this rank's own experts), ``"calls"``. Only
    the forward token exchange counts: not the per-expert counts, the results' return trip or
    the backward exchanges.

    Example:
        >>> with count_dispatched() as sent:
        ...     pass
        >>> sent["rows_to_peers"]
        0
    """
    counter: Counter = Counter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def _exchange(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int] | None,
    in_splits: list[int] | None,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    try:
        dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)
    except Exception as err:  # a peer died, raised or timed out
        raise CollectiveError(
            f"expert-parallel all_to_all over the group {describe_group(group)} failed: {err}"
        ) from err
    return out


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``in_splits`` go to the ranks in order; ``out_splits`` rows arrive
    from each. Backward sends the gradient rows back along the same routes."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        return _exchange(out, x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        return _exchange(back, grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all_rows(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Autograd-correct ``all_to_all_single`` along dim 0: ``in_splits[r]`` rows of ``x`` go to
    rank ``r`` of ``group``; ``out_splits[r]`` rows arrive from it (concatenated in rank order)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def dispatch_combine(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    expert_fn: ExpertFn,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Route ``hidden`` (``(N, H)``) to the experts ``expert_ids`` (``(N, K)``, global ids) across
    ``group``; return ``sum_k weights[:, k] * expert[expert_ids[:, k]](hidden)`` as ``(N, H)``.

    ``expert_fn(j, rows)`` runs this rank's ``j``-th local expert (global id
    ``rank * num_experts / ep + j``) on ``rows``; it is called once per local expert, also with
    zero rows, so every local expert's weights join the graph on every rank.

    Example (``ep = 1``: every expert is local):
        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> x = torch.ones(3, 2)
        >>> ids, w = torch.tensor([[0, 1]] * 3), torch.full((3, 2), 0.5)
        >>> dispatch_combine(x, ids, w, 2, lambda j, rows: rows * (j + 1)).tolist()
        [[1.5, 1.5], [1.5, 1.5], [1.5, 1.5]]
        >>> dist.destroy_process_group()
    """
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = num_experts // ep
    tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    # Sorting the (token, k) pairs by expert also groups them by owning rank.
    order = torch.argsort(flat_ids, stable=True)
    token_of = torch.arange(tokens, device=hidden.device).repeat_interleave(top_k)[order]

    # 1. counts: row (src) r, column j of ``recv`` = rows from rank r for local expert j.
    per_expert = torch.bincount(flat_ids, minlength=num_experts).to(torch.int64)
    recv = _exchange(torch.empty_like(per_expert), per_expert, None, None, group)
    send_splits = per_expert.view(ep, per_rank).sum(1).tolist()
    recv_by_rank = recv.view(ep, per_rank)
    recv_splits = recv_by_rank.sum(1).tolist()
    _record(send_splits, rank, hidden.shape[1], hidden.element_size())

    # 2. tokens out; each arrives tagged (by position) with its local expert.
    arrived = all_to_all_rows(hidden[token_of], recv_splits, send_splits, group)
    local_of = torch.arange(per_rank, device=hidden.device).repeat(ep)
    local_ids = local_of.repeat_interleave(recv_by_rank.reshape(-1).to(hidden.device))
    by_expert = torch.argsort(local_ids, stable=True)
    sizes = torch.bincount(local_ids, minlength=per_rank).tolist()
    chunks = torch.split(arrived[by_expert], sizes)
    outputs = torch.cat([expert_fn(j, rows) for j, rows in enumerate(chunks)])
    # Undo the sort by expert: results go back in the order the rows arrived.
    results = torch.empty_like(outputs).index_copy(0, by_expert, outputs)

    # 3. results back, weighted and summed per token in the original order.
    returned = all_to_all_rows(results, send_splits, recv_splits, group)
    weighted = returned * weights.reshape(-1)[order, None]
    combined = torch.zeros_like(hidden)
    return combined.index_add(0, token_of, weighted.to(hidden.dtype))


def _record(send_splits: list[int], rank: int, width: int, item_size: int) -> None:
    if not _COUNTERS:
        return
    to_peers = sum(send_splits) - send_splits[rank]
    for counter in _COUNTERS:
        counter["calls"] += 1
        counter["rows_kept"] += send_splits[rank]
        counter["rows_to_peers"] += to_peers
        counter["elements_to_peers"] += to_peers * width
        counter["bytes_to_peers"] += to_peers * width * item_size
