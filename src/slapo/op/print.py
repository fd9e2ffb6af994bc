"""``Print``: a pass-through module that reports what flows through a model, traced or not."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..logger import get_logger

__all__ = ["Print"]


class Print(nn.Module):
    """Report the arguments it is called with; return the inputs.

    Called with tensors only, it logs the shape, dtype and (with ``stats``) mean of each, to the
    Slapo logger. Called with anything else too (a message, a shape), it prints every argument to
    stdout as ``print`` does, as Slapo code calls it:
    ``self.print(out, "shape", out.shape, "value", out)``. One argument comes back as itself,
    several as a tuple.

    It stays one call in an fx graph (a leaf, which dead-code elimination keeps although its
    result is unused), so the built model prints real values at run time instead of the
    tracer's placeholders once at trace time. torch.export cannot keep such a call: it is left
    out of an exported graph, with a warning.

    Example:
        >>> p = Print("x", stats=True)
        >>> y = p(torch.ones(2, 3))  # logs "[Print x] Tensor(2, 3) torch.float32 mean=1"
        >>> _ = Print()(torch.ones(1), "has shape", torch.Size([1]))
        tensor([1.]) has shape torch.Size([1])
    """

    _slapo_trace_leaf = True  # tracers keep the call (slapo.tracing.leaves.is_leaf)
    _is_impure = True  # fx's dead-code elimination keeps a call whose result is unused

    def __init__(self, tag: str = "", stats: bool = False) -> None:
        super().__init__()
        self.tag = tag
        self.stats = stats

    def forward(self, *args: Any) -> Any:
        if torch.compiler.is_exporting():
            # torch.export would print its fake tensors once, now, and drop the call.
            get_logger().warning(
                "Print%s is left out of a torch.export graph; trace with tracer='fx' to keep it",
                f" {self.tag!r}" if self.tag else "",
            )
        elif all(isinstance(a, torch.Tensor) for a in args):
            get_logger().info("[Print %s] %s", self.tag, ", ".join(self._summary(a) for a in args))
        else:
            print(*((self.tag,) if self.tag else ()), *args, flush=True)
        return args[0] if len(args) == 1 else args

    def _summary(self, tensor: torch.Tensor) -> str:
        text = f"Tensor{tuple(tensor.shape)} {tensor.dtype}"
        if self.stats and tensor.is_floating_point():
            text += f" mean={tensor.detach().float().mean().item():.4g}"
        return text
