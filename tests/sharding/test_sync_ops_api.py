"""Slapo's sync functions as user code calls them, ``op(tensor, dim, group)``, from
``slapo.sharding.sync_ops``: each is a collective in forward and its matching collective in
backward. On 2 gloo ranks, each rank's value and gradient equal a single-process computation
over every rank's inputs (the sum of the ranks' losses, or the one replicated loss)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import slapo
from dist_utils import assert_check, check_all, run_checks, run_workers
from slapo.sharding.sync_ops import (
    all_gather_forward_output,
    reduce_backward_grad,
    reduce_forward_output,
    reduce_scatter_forward_output,
    scatter_forward_output,
)

WORLD = 2


def rank_tensor(rank: int, *shape: int, salt: int = 0) -> torch.Tensor:
    """The same tensor on every process for the same ``rank``: any rank can rebuild another's."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 * salt + rank))


def check_op(
    rank: int,
    world: int,
    run: Callable[[torch.Tensor], torch.Tensor],
    reference: Callable[[list[torch.Tensor]], torch.Tensor],
    inputs: list[torch.Tensor],
    loss: Callable[[torch.Tensor, int], torch.Tensor],
    replicated_loss: bool,
) -> None:
    """``run`` on this rank's input against ``reference`` over all ranks' inputs.

    ``inputs[r]`` is rank r's input (the same object on every rank for a replicated value);
    ``reference(inputs)[r]`` is rank r's expected output; the single-process loss is rank r's
    ``loss`` summed over the ranks, or counted once when every rank computes the same one.
    """
    mine = inputs[rank].clone().requires_grad_()
    out = run(mine)
    loss(out, rank).backward()

    # One leaf per distinct input: a replicated value is one tensor of the single process.
    leaves = {id(t): t.clone().requires_grad_() for t in inputs}
    ref_inputs = [leaves[id(t)] for t in inputs]
    expected = reference(ref_inputs)
    if replicated_loss:
        total = loss(expected[0], 0)
    else:
        total = sum(loss(expected[r], r) for r in range(world))
    total.backward()
    torch.testing.assert_close(out, expected[rank].detach())
    torch.testing.assert_close(mine.grad, ref_inputs[rank].grad)


def weighted(shape: tuple[int, ...]) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """Rank r's loss: a different weighting per rank (a tensor-parallel consumer's share)."""
    return lambda out, r: (out * rank_tensor(r, *shape, salt=9)).sum()


def sync_ops_job(rank: int, world: int) -> dict[str, str | None]:
    group = dist.new_group(list(range(world)))  # an explicit group, as Slapo code passes one
    same = [rank_tensor(0, 4, 6)] * world  # a replicated value: the same on every rank
    shards = [rank_tensor(r, 3, 2) for r in range(world)]  # each rank's own value
    partial = [rank_tensor(r, 4, 6, salt=1) for r in range(world)]  # partial sums to reduce

    def gather_tp() -> None:  # consumers tensor-parallel: the gradient is reduce-scattered
        check_op(
            rank, world,
            lambda t: all_gather_forward_output(t, 1, group),
            lambda ts: [torch.cat(ts, 1)] * world,
            shards, weighted((3, 2 * world)), replicated_loss=False,
        )  # fmt: skip

    def gather_replicated() -> None:  # one replicated loss: each rank keeps its slice
        check_op(
            rank, world,
            lambda t: all_gather_forward_output(t, -1, group, tensor_parallel_output_grad=False),
            lambda ts: [torch.cat(ts, -1)] * world,
            shards, lambda out, r: out.pow(2).sum(), replicated_loss=True,
        )  # fmt: skip

    def scatter() -> None:
        check_op(
            rank, world,
            lambda t: scatter_forward_output(t, 0, group),
            lambda ts: list(ts[0].chunk(world, 0)),
            same, weighted((4 // world, 6)), replicated_loss=False,
        )  # fmt: skip

    def reduce() -> None:
        check_op(
            rank, world,
            lambda t: reduce_forward_output(t, group),
            lambda ts: [sum(ts)] * world,
            partial, lambda out, r: out.pow(2).sum(), replicated_loss=True,
        )  # fmt: skip

    def reduce_scatter() -> None:
        check_op(
            rank, world,
            lambda t: reduce_scatter_forward_output(t, -1, group),
            lambda ts: list(sum(ts).chunk(world, -1)),
            partial, weighted((4, 6 // world)), replicated_loss=False,
        )  # fmt: skip

    def reduce_grad() -> None:
        check_op(
            rank, world,
            lambda t: reduce_backward_grad(t, group),
            lambda ts: [ts[0]] * world,
            same, weighted((4, 6)), replicated_loss=False,
        )  # fmt: skip

    def keywords_and_world_group() -> None:  # Slapo code also passes dim=/group= by keyword
        x = shards[rank]
        torch.testing.assert_close(
            all_gather_forward_output(x, dim=0, group=None), torch.cat(shards, 0)
        )
        torch.testing.assert_close(
            reduce_scatter_forward_output(partial[rank], dim=0, group=group),
            sum(partial).chunk(world, 0)[rank],
        )

    return run_checks(
        {
            "all_gather_forward_output (reduce-scatter backward)": gather_tp,
            "all_gather_forward_output (split backward)": gather_replicated,
            "scatter_forward_output": scatter,
            "reduce_forward_output": reduce,
            "reduce_scatter_forward_output": reduce_scatter,
            "reduce_backward_grad": reduce_grad,
            "keywords": keywords_and_world_group,
        }
    )


@pytest.fixture(scope="module")
def reports() -> list[dict[str, str | None]]:
    return check_all(run_workers(sync_ops_job, world=WORLD, deadline=120))


CHECKS = [
    "all_gather_forward_output (reduce-scatter backward)",
    "all_gather_forward_output (split backward)",
    "scatter_forward_output",
    "reduce_forward_output",
    "reduce_scatter_forward_output",
    "reduce_backward_grad",
    "keywords",
]


@pytest.mark.distributed
@pytest.mark.parametrize("name", CHECKS)
def test_sync_op_matches_the_single_process_computation(reports, name):
    assert_check(reports, name)


def test_a_group_where_the_dim_goes_is_a_clear_error():
    x = torch.ones(4)
    for call in (
        lambda: all_gather_forward_output(x, None, 0),
        lambda: scatter_forward_output(x, "0"),
        lambda: reduce_scatter_forward_output(x, 0.5),
    ):
        with pytest.raises(slapo.SlapoError, match=r"dim must be an int.*\(tensor, dim, group\)"):
            call()
