"""``Print``: a pass-through module that reports what flows through a traced graph."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..logger import get_logger

__all__ = ["Print"]


class Print(nn.Module):
    """Log the shape, dtype and (optionally) mean of each tensor argument; return the inputs.

    Insert it with ``sch.replace(Print("after attn"), subgraph)``-style surgery, or call it in a
    model while debugging. One argument comes back as itself, several as a tuple.

    Example:
        >>> p = Print("x", stats=True)
        >>> y = p(torch.ones(2, 3))
    """

    def __init__(self, tag: str = "", stats: bool = False) -> None:
        super().__init__()
        self.tag = tag
        self.stats = stats

    def forward(self, *args: Any) -> Any:
        parts = []
        for a in args:
            if isinstance(a, torch.Tensor):
                text = f"Tensor{tuple(a.shape)} {a.dtype}"
                if self.stats and a.is_floating_point():
                    text += f" mean={a.detach().float().mean().item():.4g}"
                parts.append(text)
            else:
                parts.append(repr(a))
        get_logger().info("[Print %s] %s", self.tag, ", ".join(parts))
        return args[0] if len(args) == 1 else args
