"""``Print``: a pass-through module that reports what flows through a model, traced or not."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..logger import get_logger

__all__ = ["Print"]


class Print(nn.Module):
    """Return the first argument unchanged; report the rest at run time.

    As Slapo code calls it, ``out = self.print(out, "shape", out.shape, "value", out)`` is an
    identity on ``out`` (use the result, so that the call stays in the dataflow graph) that
    prints every further argument to stdout as ``print`` does, preceded by ``tag`` if one is set.
    Called with the value alone, ``Print(tag)(x)`` logs a one-line summary of ``x`` instead
    (shape, dtype and, with ``stats``, the mean) to the Slapo logger.

    It stays one call in an fx graph (a leaf, which dead-code elimination keeps although its
    result may be unused), so the built model prints real values at run time instead of the
    tracer's placeholders once at trace time. torch.export cannot keep such a call: it is left
    out of an exported graph, with a warning.

    Example:
        >>> p = Print("x", stats=True)
        >>> y = p(torch.ones(2, 3))  # logs "[Print x] Tensor(2, 3) torch.float32 mean=1"
        >>> y = Print()(torch.ones(1), "has shape", torch.Size([1]))  # y is the tensor
        has shape torch.Size([1])
    """

    _slapo_trace_leaf = True  # tracers keep the call (slapo.tracing.leaves.is_leaf)
    _is_impure = True  # fx's dead-code elimination keeps a call whose result is unused

    def __init__(self, tag: str = "", stats: bool = False) -> None:
        super().__init__()
        self.tag = tag
        self.stats = stats

    def forward(self, value: Any, *message: Any) -> Any:
        if torch.compiler.is_exporting():
            # torch.export would print its fake tensors once, now, and drop the call.
            get_logger().warning(
                "Print%s is left out of a torch.export graph; trace with tracer='fx' to keep it",
                f" {self.tag!r}" if self.tag else "",
            )
        elif message:
            print(*((self.tag,) if self.tag else ()), *message, flush=True)
        else:
            get_logger().info("[Print %s] %s", self.tag, self._summary(value))
        return value

    def _summary(self, value: Any) -> str:
        if not isinstance(value, torch.Tensor):
            return repr(value)
        text = f"Tensor{tuple(value.shape)} {value.dtype}"
        if self.stats and value.is_floating_point():
            text += f" mean={value.detach().float().mean().item():.4g}"
        return text
