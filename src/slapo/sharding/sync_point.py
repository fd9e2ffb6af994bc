"""Sync points: the op of one ``sync(mode=...)`` as a call that a traced graph can hold.

``sync`` hooks a module. When a trace goes through that module (``trace(flatten=True)``, a
decomposed layer inlined into its caller), the module call disappears from the graph and its
hooks with it; so the hooks run on the tracer's proxies and record a :class:`SyncPoint` call
where they would have run. The graph then all-reduces (say) at the same place at run time.

Example:
    >>> point = SyncPoint("fwd_pre", lambda t: t * 2, "fc1")
    >>> point(torch.ones(2))
    tensor([2., 2.])
    >>> gm = torch.fx.symbolic_trace(lambda x: sync_at(x + 1, point))
    >>> [n.name for n in gm.graph.nodes]
    ['x', 'add', 'sync_fwd_pre_fc1', 'output']
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from .sync_ops import on_grad

__all__ = ["SyncPoint", "is_symbolic", "sync_at"]


class SyncPoint:
    """Run the op of ``sync(mode)`` on ``path``'s main input or output: ``fwd_pre`` and
    ``fwd_post`` apply it to the value, ``bwd_post`` to the value's gradient in backward.

    A callable object (not a closure) so that an fx graph names it after the mode and the module
    (``sync_bwd_post_linear1``) and prints it readably.
    """

    def __init__(self, mode: str, op: Callable[[torch.Tensor], torch.Tensor], path: str) -> None:
        self.mode = mode
        self.op = op
        self.path = path
        self.__name__ = re.sub(r"\W", "_", f"sync_{mode}_{path}".rstrip("_"))

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.mode != "bwd_post":
            return self.op(tensor)
        if not tensor.requires_grad:  # no gradient will flow back through this value
            return tensor
        return on_grad(tensor, self.op)

    def __repr__(self) -> str:
        return f"SyncPoint({self.mode!r}, path={self.path!r})"


def is_symbolic(value: Any) -> bool:
    """Whether ``value`` is a tracer's stand-in for a tensor (an fx ``Proxy``)."""
    return isinstance(value, fx.Proxy)


def sync_at(value: Any, point: SyncPoint) -> Any:
    """``point(value)`` now, or, for a proxy (a trace is going through the hooked module), a call
    of ``point`` recorded in the graph being traced."""
    if is_symbolic(value):
        return value.tracer.create_proxy("call_function", point, (value,), {})
    return point(value)
