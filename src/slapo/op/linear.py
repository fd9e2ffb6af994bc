"""Fused linear projections: one matmul for the query, key and value of attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..exceptions import OpError

__all__ = ["FusedQKV"]


class FusedQKV(nn.Module):
    """The query, key and value projections of ``num_heads`` attention heads in one matmul.

    ``forward(x)`` returns ``(q, k, v)``, each ``[..., hidden_size]`` (``[..., hidden_size /
    world_size]`` once sharded), heads in order, as three ``nn.Linear(hidden_size, hidden_size)``
    would give. The ``weight`` (``[3 * hidden_size, hidden_size]``) and ``bias`` rows are laid out
    rank by rank: ``[q, k, v of the heads of rank 0; q, k, v of rank 1; ...]`` for
    ``world_size`` ranks, so that ``shard("weight", axis=0)`` and ``shard("bias", axis=0)`` give
    every rank the q, k and v of whole heads of its own; the attention that follows then runs on
    ``num_heads / world_size`` heads per rank with no communication.

    Args:
        hidden_size: the input and per-projection output size.
        num_heads: the number of attention heads (divides ``hidden_size``).
        world_size: the tensor-parallel group size the rows are laid out for (divides
            ``num_heads``); 1 for a single device.
        bias: whether the projections have a bias.

    Example:
        >>> q_proj, k_proj, v_proj = (nn.Linear(8, 8) for _ in range(3))
        >>> qkv = FusedQKV.from_linears(q_proj, k_proj, v_proj, num_heads=2, world_size=2)
        >>> x = torch.randn(3, 5, 8)
        >>> q, k, v = qkv(x)
        >>> torch.allclose(k, k_proj(x), atol=1e-6)
        True
        >>> # with sch = slapo.create_schedule(model) on 2 ranks, qkv replacing the three:
        >>> # sch["attn.qkv"].shard("weight", axis=0); sch["attn.qkv"].shard("bias", axis=0)
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        world_size: int = 1,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if num_heads < 1 or hidden_size % num_heads:
            raise OpError(f"FusedQKV: num_heads={num_heads} must divide hidden_size={hidden_size}")
        if world_size < 1 or num_heads % world_size:
            raise OpError(
                f"FusedQKV: world_size={world_size} must divide num_heads={num_heads} (each rank "
                "holds whole heads)"
            )
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.world_size = world_size
        self.head_size = hidden_size // num_heads
        # Linear-style shape attributes; shard's rule sets out_features to the local rows.
        self.in_features = hidden_size
        self.out_features = 3 * hidden_size
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(3 * hidden_size, hidden_size, **factory))
        self.bias = nn.Parameter(torch.empty(3 * hidden_size, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize as three ``nn.Linear(hidden_size, hidden_size)`` would be."""
        if self.weight.is_meta:
            return
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linears(
        cls,
        query: nn.Linear,
        key: nn.Linear,
        value: nn.Linear,
        num_heads: int,
        world_size: int = 1,
    ) -> FusedQKV:
        """A FusedQKV with the weights of three existing projections (an exact replacement).

        The new parameters copy the given ones (on their device and dtype; meta stays meta).

        Example:
            >>> attn = nn.ModuleDict({n: nn.Linear(8, 8) for n in ("q", "k", "v")})
            >>> qkv = FusedQKV.from_linears(attn["q"], attn["k"], attn["v"], num_heads=4)
            >>> qkv.weight.shape
            torch.Size([24, 8])
        """
        linears = (query, key, value)
        shapes = {tuple(lin.weight.shape) for lin in linears}
        if len(shapes) != 1 or (shape := shapes.pop())[0] != shape[1]:
            raise OpError(
                "FusedQKV.from_linears needs three square projections of one size, got weights "
                f"of shapes {[tuple(lin.weight.shape) for lin in linears]}"
            )
        biased = [lin.bias is not None for lin in linears]
        if len(set(biased)) != 1:
            raise OpError("FusedQKV.from_linears: either all three projections have a bias or none")
        weight = query.weight
        fused = cls(
            shape[0],
            num_heads,
            world_size,
            bias=biased[0],
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            fused.weight.copy_(fused.interleave(*(lin.weight for lin in linears)))
            if fused.bias is not None:
                fused.bias.copy_(fused.interleave(*(lin.bias for lin in linears)))
        return fused

    def interleave(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The full (unsharded) rows of this layout from q, k and v rows in head order."""
        per_rank = [t.chunk(self.world_size, 0) for t in (q, k, v)]
        return torch.cat([part for rank in zip(*per_rank) for part in rank], 0)

    def split(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v rows in head order from rows of this layout (the inverse of interleave)."""
        blocks = fused.reshape(self.world_size, 3, -1, *fused.shape[1:])
        return tuple(blocks[:, i].reshape(-1, *fused.shape[1:]) for i in range(3))  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = F.linear(x, self.weight, self.bias)
        # The rows hold whole blocks of [q; k; v] of hidden/world_size each: one block per rank
        # once sharded, world_size blocks unsharded (read from the weight: shard swaps it).
        block = self.hidden_size // self.world_size
        blocks = out.unflatten(-1, (self.weight.shape[0] // (3 * block), 3, block))
        q, k, v = blocks.unbind(-2)
        return q.flatten(-2), k.flatten(-2), v.flatten(-2)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
            f"world_size={self.world_size}, bias={self.bias is not None}"
        )
