"""The knobs of a ready schedule, checked once so that every family reads them as plain values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..exceptions import SlapoError
from ..sharding import resolve_group

__all__ = ["Knobs", "ATTN_OPS"]

ATTN_OPS = ("eager", "sdpa", "flash")


@dataclass(frozen=True)
class Knobs:
    """The options of :func:`slapo.model_schedule.apply_schedule`, validated.

    Attributes:
        group: tensor parallelism over this ProcessGroup or 1-D DeviceMesh; None: no TP.
        sequence_parallel: shard the activations between TP regions over the sequence.
        ckpt_ratio: fraction of the blocks checkpointed (the first ones), in [0, 1].
        attn_op: the attention kernel ("eager", "sdpa", "flash" on CUDA); None keeps the model's.
        fuse_ops: fuse bias+GELU and bias+dropout+residual where the family has them.
        fused_loss: chunked LM head + cross-entropy (the full logits never exist).
        num_stages: pipeline stages (cuts between blocks, for the "pipeline" target).

    Example:
        >>> Knobs(ckpt_ratio=0.5).ckpt_ratio
        0.5
    """

    group: Any = None
    sequence_parallel: bool = False
    ckpt_ratio: float = 0.0
    attn_op: str | None = None
    fuse_ops: bool = False
    fused_loss: bool = False
    num_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("sequence_parallel", "fuse_ops", "fused_loss"):
            if not isinstance(getattr(self, name), bool):
                raise SlapoError(f"{name} must be True or False, got {getattr(self, name)!r}")
        ratio = self.ckpt_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            raise SlapoError(f"ckpt_ratio must be a number in [0, 1], got {ratio!r}")
        if self.attn_op is not None and self.attn_op not in ATTN_OPS:
            raise SlapoError(f"attn_op must be one of {ATTN_OPS} or None, got {self.attn_op!r}")
        if self.attn_op == "flash" and not torch.cuda.is_available():
            raise SlapoError("attn_op='flash' needs CUDA; use attn_op='sdpa' on CPU")
        stages = self.num_stages
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise SlapoError(f"num_stages must be a positive int, got {stages!r}")
        if self.sequence_parallel and self.group is None:
            raise SlapoError(
                "sequence_parallel=True needs tensor parallelism: pass group= (a ProcessGroup or "
                "a 1-D DeviceMesh) too"
            )

    @property
    def tensor_parallel(self) -> bool:
        return self.group is not None

    def as_dict(self) -> dict[str, Any]:
        """The knobs as a dict (the group as its size), for logs and ``sch.extra``."""
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["group"] = None if self.group is None else _describe(self.group)
        return out


def _describe(group: Any) -> str:
    pg = resolve_group(group)
    return f"tp{dist.get_world_size(pg)}"
