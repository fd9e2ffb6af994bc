"""Mode-aware rewrite: tracing runs in training mode, so train-mode dropout is baked into the
graph; it is replaced by modules that follow ``module.train()``/``eval()`` again."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..surgery import unique_name

__all__ = ["ModeDropout", "TrainingOnly", "make_mode_aware"]


class ModeDropout(nn.Module):
    """Dropout with probability ``p`` that follows the owning module's train/eval mode.

    Tracing bakes ``F.dropout(x, p, self.training)`` into a constant; the trace replaces such
    calls with this module so ``model.eval()`` still switches dropout off.

    Example:
        >>> drop = ModeDropout(0.5).eval()
        >>> bool((drop(torch.ones(4)) == 1).all())
        True
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class TrainingOnly(nn.Module):
    """Return ``value`` in training mode and ``0.0`` in eval mode (e.g. attention dropout_p).

    Example:
        >>> flag = TrainingOnly(0.1)
        >>> flag(), flag.eval()()
        (0.1, 0.0)
    """

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self) -> float:
        return self.value if self.training else 0.0

    def extra_repr(self) -> str:
        return f"value={self.value}"


_DROPOUTS = {F.dropout, torch.dropout, torch.ops.aten.dropout.default}
_SDPAS = {F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}


def _arg(node: fx.Node, index: int, name: str, default: Any) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def make_mode_aware(gm: fx.GraphModule) -> int:
    """Replace train-mode dropout baked into ``gm``'s graph by mode-following modules.

    Returns how many nodes were rewritten. Dropout calls become :class:`ModeDropout`; a non-zero
    ``dropout_p`` of scaled-dot-product attention is read from a :class:`TrainingOnly` module.

    Example:
        >>> gm = fx.symbolic_trace(lambda x: F.dropout(x, 0.1, True))
        >>> make_mode_aware(gm), type(gm._slapo_dropout_0).__name__
        (1, 'ModeDropout')
    """
    count = 0
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _DROPOUTS:
            p = _arg(node, 1, "p", 0.5)
            train = _arg(node, 2, "training" if node.target is F.dropout else "train", True)
            if train is not True or not isinstance(p, float):
                continue
            name = unique_name(gm, "_slapo_dropout", numbered=True)
            gm.add_submodule(name, ModeDropout(p))
            with graph.inserting_before(node):
                new = graph.call_module(name, (node.args[0],))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            count += 1
        elif node.target in _SDPAS:
            p = _arg(node, 4, "dropout_p", 0.0)
            if not isinstance(p, float) or p == 0.0:
                continue
            name = unique_name(gm, "_slapo_attn_dropout_p", numbered=True)
            gm.add_submodule(name, TrainingOnly(p))
            with graph.inserting_before(node):
                flag = graph.call_module(name, ())
            if "dropout_p" in node.kwargs:
                node.update_kwarg("dropout_p", flag)
            else:
                node.update_arg(4, flag)
            count += 1
    if count:
        gm.recompile()
    return count
