"""Reshard specs such as ``"RS->SR"``: change which dimensions of an activation are sharded.

A spec names the placement of the tensor's last dimensions before and after the arrow, one letter
per dimension: ``R`` replicated, ``S`` sharded over the group. For a ``[batch, seq, hidden]``
activation a two-letter spec covers ``(seq, hidden)``: ``"RS->SR"`` turns a hidden-sharded tensor
(the output of a column-parallel layer) into a sequence-sharded one. Every two-letter spec
(:data:`SPECS`) is a ``sync`` op (``sync_ops`` registers them); gradients follow the reverse path
(a gathered dimension is split back, a split one gathered), as for a replicated loss.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ..exceptions import SlapoError
from .collectives import all_gather, scatter

__all__ = ["reshard", "parse_spec", "SPECS"]

_TWO_DIMS = ["".join(p) for p in itertools.product("RS", repeat=2)]
# Every two-letter spec that changes something: "RR->RS", ..., "SS->SR".
SPECS = tuple(f"{a}->{b}" for a, b in itertools.product(_TWO_DIMS, repeat=2) if a != b)


def parse_spec(spec: str) -> tuple[str, str]:
    """Split ``"RS->SR"`` into ``("RS", "SR")``, checking the letters.

    Example:
        >>> parse_spec("RS->SR")
        ('RS', 'SR')
    """
    parts = spec.replace(" ", "").split("->")
    if len(parts) != 2 or len(parts[0]) != len(parts[1]) or not parts[0]:
        raise SlapoError(f'reshard spec "{spec}" must look like "RS->SR" (same length both sides)')
    bad = set(parts[0] + parts[1]) - {"R", "S"}
    if bad:
        raise SlapoError(
            f'reshard spec "{spec}": unknown placement letters {sorted(bad)}; use R, S'
        )
    return parts[0], parts[1]


def reshard(tensor: torch.Tensor, spec: str, group: Any = None) -> torch.Tensor:
    """Reshard ``tensor`` from the placements before the arrow to those after it.

    Gathers happen before splits, so ``"RS->SR"`` all-gathers the hidden dimension, then keeps this
    rank's slice of the sequence.

    Example (in a 2-rank job):
        >>> y = reshard(torch.ones(2, 6, 4), "RS->SR")  # shape (2, 3, 8)  # doctest: +SKIP
    """
    src, dst = parse_spec(spec)
    if tensor.dim() < len(src):
        raise SlapoError(
            f'reshard "{spec}" covers the last {len(src)} dimensions, but the tensor has shape '
            f"{tuple(tensor.shape)}"
        )
    dims = range(-len(src), 0)
    for dim, a, b in zip(dims, src, dst):
        if a == "S" and b == "R":
            tensor = all_gather(tensor, group=group, dim=dim)
    for dim, a, b in zip(dims, src, dst):
        if a == "R" and b == "S":
            tensor = scatter(tensor, group=group, dim=dim)
    return tensor
