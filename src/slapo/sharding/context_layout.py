"""Load-balanced sequence layout of context parallelism: which tokens each rank of a cp group holds.

A cp group of size ``C`` cuts the sequence into ``2C`` equal chunks; rank ``r`` holds chunks ``r``
and ``2C-1-r``, in that order. Under a causal mask an early chunk attends to few keys and a late
one to many, so pairing them gives every rank the same attention cost (a plain ``C``-way split
would leave the last rank with most of the work).

Everything here is local (no communication) except :func:`gather_sequence`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..exceptions import SlapoError

__all__ = [
    "ContextParallelError",
    "local_chunks",
    "local_positions",
    "global_order",
    "split_sequence",
    "merge_sequence",
    "gather_sequence",
]


class ContextParallelError(SlapoError, ValueError):
    """Context parallelism applied where it cannot be (a sequence that does not divide, a model
    whose attention does not go through transformers' attention interface, a non-causal model)."""


def check_divisible(seq_len: int, world: int, where: str = "") -> None:
    """Raise :class:`ContextParallelError` unless ``seq_len`` divides into ``2 * world`` chunks."""
    if world < 1:
        raise ContextParallelError(f"{where}context-parallel size must be >= 1, got {world}")
    if seq_len % (2 * world) != 0:
        raise ContextParallelError(
            f"{where}sequence length {seq_len} does not divide by 2 * cp size = {2 * world} "
            f"(cp size {world}): pad or truncate the sequences to a multiple of {2 * world}"
        )


def local_chunks(rank: int, world: int) -> tuple[int, int]:
    """The two chunk indices (of ``2 * world``) that ``rank`` holds, in local order.

    Example:
        >>> local_chunks(0, 2), local_chunks(1, 2)
        ((0, 3), (1, 2))
    """
    if not 0 <= rank < world:
        raise ContextParallelError(f"rank {rank} is outside a context-parallel group of {world}")
    return rank, 2 * world - 1 - rank


def local_positions(
    seq_len: int, rank: int, world: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions (token indices in the full sequence) of the tokens ``rank`` holds.

    Example:
        >>> local_positions(8, 1, 2).tolist()
        [2, 3, 4, 5]
    """
    check_divisible(seq_len, world)
    chunk = seq_len // (2 * world)
    first, second = local_chunks(rank, world)
    base = torch.arange(chunk, device=device)
    return torch.cat([base + first * chunk, base + second * chunk])


def global_order(chunk: int, world: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Index that puts the rank-ordered concatenation of every rank's tokens (what an all-gather
    returns) back into global sequence order; ``chunk`` is the length of one chunk.

    Example:
        >>> global_order(1, 2).tolist()  # gathered [c0, c3, c1, c2] -> [c0, c1, c2, c3]
        [0, 2, 3, 1]
    """
    index = []
    for g in range(2 * world):
        owner, slot = (g, 0) if g < world else (2 * world - 1 - g, 1)
        index.append(torch.arange(chunk, device=device) + (2 * owner + slot) * chunk)
    return torch.cat(index)


def split_sequence(t: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``t`` along ``dim``, concatenated (load-balanced split).

    Example:
        >>> split_sequence(torch.arange(8)[None], 1, 2).tolist()
        [[2, 3, 4, 5]]
    """
    check_divisible(t.shape[dim], world, "split_sequence: ")
    chunks = t.chunk(2 * world, dim)
    first, second = local_chunks(rank, world)
    return torch.cat([chunks[first], chunks[second]], dim)


def merge_sequence(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Undo :func:`split_sequence`: ``parts[r]`` is rank ``r``'s local tensor.

    Example:
        >>> x = torch.arange(8)[None]
        >>> bool((merge_sequence([split_sequence(x, r, 2) for r in range(2)]) == x).all())
        True
    """
    world = len(parts)
    local = parts[0].shape[dim]
    if local % 2 != 0:
        raise ContextParallelError(
            f"merge_sequence: a local length of {local} (dimension {dim}) is not two equal chunks"
        )
    joined = torch.cat(list(parts), dim)
    return joined.index_select(dim, global_order(local // 2, world, joined.device))


def gather_sequence(t: torch.Tensor, group: Any = None, dim: int = 1) -> torch.Tensor:
    """All-gather every rank's local ``t`` over the cp ``group`` and return the full sequence in
    global order (no gradient; e.g. for logits or a padding mask).

    Example (in a 2-rank job):
        >>> local_logits = torch.randn(1, 4, 16)  # this rank's half of an 8-token sequence
        >>> group = None  # the context-parallel group (None: the default group)
        >>> full = gather_sequence(local_logits, group, dim=1)  # doctest: +SKIP
    """
    from .collectives import _all_gather
    from .groups import resolve_group

    pg = resolve_group(group, "gather_sequence")
    world = dist.get_world_size(pg)
    if t.shape[dim] % 2 != 0:
        raise ContextParallelError(
            f"gather_sequence: a local length of {t.shape[dim]} (dimension {dim}) is not two "
            "equal chunks; pass a tensor split by split_sequence / shard_batch"
        )
    # gloo gathers no bool tensors: carry them as uint8
    src = t.detach()
    wire = src.to(torch.uint8) if src.dtype == torch.bool else src
    joined = _all_gather(wire, pg, dim, "fwd").to(src.dtype)
    local = t.shape[dim]
    return joined.index_select(dim, global_order(local // 2, world, joined.device))
