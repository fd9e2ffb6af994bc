"""How one parameter is sharded: which axis, over which group, and how to cut or rebuild it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .collectives import run_collective

__all__ = ["ShardSpec", "get_shard_spec", "SPEC_ATTR"]

# The attribute a sharded parameter carries; ``materialize_module`` keeps parameter attributes.
SPEC_ATTR = "slapo_shard"


@dataclass(frozen=True)
class ShardSpec:
    """The layout of a sharded parameter.

    Attributes:
        axis: the sharded axis.
        world: the group size; rank: this rank in the group.
        full_shape: the original (unsharded, unpadded) shape.
        padded: the size of ``axis`` after padding to a multiple of ``world`` (the original size
            when not padded).
        fused: how many equal blocks are concatenated along ``axis`` (3 for GPT-2's fused q/k/v);
            each block is sharded on its own so that every rank gets a slice of each.
        group: the process group (None: the world).

    Example:
        >>> spec = ShardSpec(axis=0, world=2, rank=1, full_shape=(4, 3), padded=4)
        >>> spec.local_slice(torch.arange(12.0).view(4, 3))[:, 0]
        tensor([6., 9.])
    """

    axis: int
    world: int
    rank: int
    full_shape: tuple[int, ...]
    padded: int
    fused: int = 1
    group: Any = field(default=None, compare=False, repr=False)

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.axis] = self.padded // self.world
        return tuple(shape)

    @property
    def local_range(self) -> tuple[int, int]:
        """The ``[start, end)`` of this rank's rows of the padded axis (unfused specs)."""
        size = self.padded // self.world
        return self.rank * size, (self.rank + 1) * size

    def pad(self, full: torch.Tensor) -> torch.Tensor:
        extra = self.padded - full.shape[self.axis]
        if extra == 0:
            return full
        widths = [0, 0] * (full.dim() - 1 - self.axis) + [0, extra]
        return F.pad(full, widths)

    def local_slice(self, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """This rank's (or ``rank``'s) shard of the full, unpadded tensor."""
        rank = self.rank if rank is None else rank
        blocks = self.pad(full).chunk(self.fused, self.axis)
        return torch.cat([b.chunk(self.world, self.axis)[rank] for b in blocks], self.axis).clone()

    def assemble(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full, unpadded tensor from every rank's shard, in rank order."""
        per_rank = [s.chunk(self.fused, self.axis) for s in shards]
        blocks = [torch.cat([p[i] for p in per_rank], self.axis) for i in range(self.fused)]
        full = torch.cat(blocks, self.axis)
        return full.narrow(self.axis, 0, self.full_shape[self.axis]).contiguous()

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """All-gather the shards over the group and assemble the full tensor (no autograd)."""
        local = local.detach().contiguous()
        shards = [torch.empty_like(local) for _ in range(self.world)]
        run_collective(
            "all_gather", self.group, lambda: dist.all_gather(shards, local, group=self.group)
        )
        return self.assemble(shards)


def get_shard_spec(tensor: Any) -> ShardSpec | None:
    """The :class:`ShardSpec` of a parameter sharded by ``shard``, or None."""
    return getattr(tensor, SPEC_ATTR, None)
