"""How a top-k router's scores follow from its logits, for routers no preset names.

A transformers top-k router returns ``(router_logits, scores, expert_indices)``. To replay a
saved routing in recompute, RoundPipe must recompute the scores at the saved experts from the
new logits (so they stay differentiable). The presets name the rule of their routers
(:data:`roundpipe.models.moe.ROUTER_SCORES`); for any other router the rule is found on its
first forward call: the first of :data:`SCORE_RULES` that reproduces the scores the router
returned (same shape, equal within float tolerance) is the rule of that router class.

A router that no rule reproduces is still safe: its recompute runs as it is and must choose
the same experts as the forward did, else :class:`RoutingReplayError` names the router.

Example:
    >>> import torch
    >>> logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]])
    >>> idx = torch.tensor([[1, 3]])
    >>> scores = torch.softmax(logits, -1).gather(-1, idx)
    >>> find_score_rule(torch.nn.Identity(), logits, scores, idx).__name__
    'softmax_then_gather'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import RoundPipeError

__all__ = [
    "SCORE_RULES",
    "RoutingReplayError",
    "ScoreFn",
    "find_score_rule",
    "is_topk_triple",
]

# (router, logits, chosen expert indices) -> the scores of the chosen experts
ScoreFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class RoutingReplayError(RoundPipeError, RuntimeError):
    """A router's recompute chose other experts than its forward, and no score rule lets
    RoundPipe impose the forward's choice."""


def softmax_then_gather(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> Any:
    """Mixtral, Qwen2/3-MoE, OLMoE & co.: the fp32 softmax at the chosen experts."""
    return torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx).to(logits.dtype)


def softmax_gather_renormalised(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> Any:
    """As :func:`softmax_then_gather`, renormalised over the k chosen experts."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)
    return (probs / probs.sum(dim=-1, keepdim=True)).to(logits.dtype)


def topk_then_softmax(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> Any:
    """GPT-OSS, Granite-MoE & co.: a softmax over the k chosen logits."""
    top = logits.gather(-1, idx)
    return torch.softmax(top.float(), dim=-1).to(logits.dtype)


def sigmoid_then_gather(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> Any:
    """Sigmoid gates at the chosen experts."""
    return torch.sigmoid(logits.float()).gather(-1, idx).to(logits.dtype)


def sigmoid_gather_renormalised(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> Any:
    """Sigmoid gates at the chosen experts, renormalised over the k (DeepSeek-V3 style, times
    the router's ``routed_scaling_factor`` where it has one)."""
    gates = torch.sigmoid(logits.float()).gather(-1, idx)
    gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
    return (gates * getattr(router, "routed_scaling_factor", 1.0)).to(logits.dtype)


#: Tried in order on a router's first call; the first that reproduces its scores is its rule.
SCORE_RULES: tuple[ScoreFn, ...] = (
    softmax_then_gather,
    softmax_gather_renormalised,
    topk_then_softmax,
    sigmoid_then_gather,
    sigmoid_gather_renormalised,
)


def is_topk_triple(output: Any) -> bool:
    """Whether a router call returned ``(logits, scores, indices)``: scores and integer indices
    of one shape, logits over the experts for the same tokens.

    Example:
        >>> is_topk_triple((torch.zeros(3, 4), torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.long)))
        True
    """
    if not (isinstance(output, tuple) and len(output) == 3):
        return False
    logits, scores, idx = output
    return (
        isinstance(logits, torch.Tensor)
        and isinstance(scores, torch.Tensor)
        and isinstance(idx, torch.Tensor)
        and not idx.is_floating_point()
        and scores.shape == idx.shape
        and logits.dim() == idx.dim()
        and logits.shape[:-1] == idx.shape[:-1]
    )


def find_score_rule(
    router: nn.Module, logits: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor
) -> ScoreFn | None:
    """The first rule of :data:`SCORE_RULES` that gives ``scores`` from ``(logits, idx)``, or
    ``None`` (the router's output is not a top-k triple, or no rule reproduces it)."""
    if not is_topk_triple((logits, scores, idx)):
        return None
    with torch.no_grad():
        for rule in SCORE_RULES:
            try:
                got = rule(router, logits.detach(), idx)
            except RuntimeError:  # a shape the rule cannot take
                continue
            if got.shape == scores.shape and torch.allclose(
                got.float(), scores.detach().float(), rtol=1e-4, atol=1e-6
            ):
                return rule
    return None
