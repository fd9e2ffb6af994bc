"""Mixture-of-experts support for the decoder presets: routing replay and the router loss.

Routing. A transformers top-k router returns ``(router_logits, scores, expert_indices)``. While a
preset MoE block runs, a forward hook on each router records its output; in RoundPipe's
forward the chosen experts are kept with :func:`~roundpipe.save_for_recompute`, and in the
backward's recompute the hook replaces the router's choice by the saved one (the scores are
recomputed from the new logits at those experts, so they stay differentiable). Forward and
recompute thus send every token to the same experts even where top-k could tip (ties, a
nondeterministic kernel, low precision). Outside a preset block the hook does nothing.

Router loss. transformers' ``load_balancing_loss_func`` is, over all layers and all tokens of
the batch, ``E * sum_e (T_e / R) * (P_e / R)``: ``T_e`` counts the tokens routed to expert ``e``
(top-k of the softmax), ``P_e`` sums their router probabilities, ``R`` counts the rows (both
weighted by the attention mask). ``T`` and ``R`` are constants and ``P`` is linear in the
tokens, so each microbatch carries its own ``(T, P, R)`` down the pipeline (``E`` numbers per
MoE layer, not the logits); the merge adds them up and the loss is made once from the sums:
the same value and the same gradients as the full batch in one piece.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from ..errors import RoundPipeRuntimeError
from ..runtime.context import doing_recompute, get_recompute_data, save_for_recompute
from .causal_lm import CausalLMRoundPipe
from .decoder import DecoderBlock, DecoderHead
from .routing import RoutingReplayError, ScoreFn, find_score_rule, is_topk_triple

__all__ = [
    "MoECausalLMRoundPipe",
    "MoEDecoderBlock",
    "MoEDecoderHead",
    "RouterStatsOutput",
    "install_router_hooks",
    "router_aux_loss",
]

# class names of the modules hooked as routers besides ROUTER_SCORES' (Mixtral's
# MixtralTopKRouter, DeepSeek's DeepseekV3TopkRouter, HunYuan's HunYuanMoEV1Gate, ...)
ROUTER_NAME = re.compile(r"(Router|Gate)$")


def _softmax_then_topk_scores(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> Any:
    """Qwen3-MoE & co.: top-k of the fp32 softmax, optionally renormalised over the k."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)
    if getattr(router, "norm_topk_prob", False):
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.to(logits.dtype)


def _topk_then_softmax_scores(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> Any:
    """GPT-OSS: softmax over the k chosen logits."""
    top = logits.gather(-1, idx)
    return torch.softmax(top, dim=1, dtype=top.dtype)


ROUTER_SCORES: dict[str, ScoreFn] = {
    "Qwen3MoeTopKRouter": _softmax_then_topk_scores,
    "GptOssTopKRouter": _topk_then_softmax_scores,
}

_local = threading.local()  # the routing session of the block running in this thread


class _RoutingSession:
    """What the routers of one block call saw: their logits and expert choices, in call order;
    ``replay`` (recompute) holds the choices to impose."""

    def __init__(self, replay: tuple[torch.Tensor, ...] | None) -> None:
        self.replay = replay
        self.logits: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []


@contextlib.contextmanager
def _routing_session(replay: tuple[torch.Tensor, ...] | None) -> Iterator[_RoutingSession]:
    previous = getattr(_local, "session", None)
    session = _local.session = _RoutingSession(replay)
    try:
        yield session
    finally:
        _local.session = previous


def _router_hook(router: nn.Module, args: Any, output: Any) -> Any:
    """Record (and in recompute, replay) one router call inside a preset MoE block."""
    session: _RoutingSession | None = getattr(_local, "session", None)
    if session is None or not is_topk_triple(output):  # outside RoundPipe, or not a top-k call
        return None
    logits, scores, idx = output
    rule = score_rule(router, logits, scores, idx, session.replay is not None)
    if session.replay is not None:
        k = len(session.logits)
        if k >= len(session.replay):
            raise RoundPipeRuntimeError("a MoE block called its routers more often in recompute")
        saved = session.replay[k].to(idx.device)
        if rule is not None:
            idx = saved
            scores = rule(router, logits, idx)
        elif not torch.equal(saved, idx):
            raise RoutingReplayError(
                f"router {type(router).__name__} chose other experts in recompute than in "
                "forward, and RoundPipe knows no rule to recompute its scores at the forward's "
                "choice: add one to roundpipe.models.moe.ROUTER_SCORES"
            )
    session.logits.append(logits)
    session.indices.append(idx.detach())
    return logits, scores, idx


# router class name -> its rule as found on the first call (None: no rule reproduces it)
_FOUND_RULES: dict[str, ScoreFn | None] = {}


def score_rule(
    router: nn.Module, logits: Any, scores: Any, idx: Any, replaying: bool
) -> ScoreFn | None:
    """The score rule of ``router``: the preset's (:data:`ROUTER_SCORES`), else the one found
    on its first forward call (:func:`~roundpipe.models.routing.find_score_rule`)."""
    name = type(router).__name__
    if name in ROUTER_SCORES:
        return ROUTER_SCORES[name]
    if name not in _FOUND_RULES and not replaying:
        _FOUND_RULES[name] = find_score_rule(router, logits, scores, idx)
    return _FOUND_RULES.get(name)


def is_router(module: nn.Module) -> bool:
    """Whether ``module`` looks like a transformers router (a preset's router class, or a class
    named ``...Router``/``...Gate``); its hook acts only on calls returning a top-k triple."""
    name = type(module).__name__
    return name in ROUTER_SCORES or ROUTER_NAME.search(name) is not None


def install_router_hooks(model: nn.Module) -> int:
    """Hook every router of ``model`` (once); returns how many it has.

    Example:
        >>> install_router_hooks(nn.Linear(2, 2))
        0
    """
    n = 0
    for module in model.modules():
        if not is_router(module):
            continue
        n += 1
        if not getattr(module, "_roundpipe_router_hooked", False):
            module.register_forward_hook(_router_hook)
            module._roundpipe_router_hooked = True
    return n


# -- router statistics -------------------------------------------------------------------
def _layer_stats(
    logits: torch.Tensor, top_k: int, num_experts: int, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One router call's ``(T, P, R)``, as ``load_balancing_loss_func`` accumulates them."""
    probs = torch.softmax(logits, dim=-1)
    _, chosen = torch.topk(probs, top_k, dim=-1)
    rows = probs.shape[0]
    weight = (
        torch.ones(rows, dtype=torch.long, device=logits.device)
        if mask is None
        else mask.reshape(-1).to(device=logits.device, dtype=torch.long)
    )
    counts = torch.zeros(num_experts, dtype=torch.long, device=logits.device)
    counts.scatter_add_(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
    prob_sum = (probs.float() * weight.to(torch.float32).unsqueeze(-1)).sum(dim=0)
    return counts, prob_sum, weight.sum()


def add_router_stats(
    stats: tuple[torch.Tensor, ...] | None,
    logits: list[torch.Tensor],
    top_k: int,
    num_experts: int,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, ...] | None:
    """``stats`` (``None``: nothing yet) plus the ``(T, P, R)`` of each router call."""
    for layer_logits in logits:
        t, p, r = _layer_stats(layer_logits, top_k, num_experts, mask)
        stats = (t, p, r) if stats is None else (stats[0] + t, stats[1] + p, stats[2] + r)
    return stats


def router_aux_loss(
    tokens: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """The load-balancing loss from summed statistics (``T``, ``P``, ``R`` above).

    Example:
        >>> router_aux_loss(torch.tensor([2, 2]), torch.tensor([1.0, 1.0]), torch.tensor(2), 2)
        tensor(2.)
    """
    per_expert = tokens.to(torch.float32) / rows
    prob_per_expert = probs / rows
    return torch.sum(per_expert * prob_per_expert.unsqueeze(0)) * num_experts


@dataclass
class RouterStatsOutput(MoeCausalLMOutputWithPast):
    """A microbatch's output with its router statistics (merged by summing, then turned into
    the router loss by the preset model)."""

    expert_tokens: torch.Tensor | None = None
    expert_probs: torch.Tensor | None = None
    routed_rows: torch.Tensor | None = None


STATS_FIELDS = ("expert_tokens", "expert_probs", "routed_rows")


# -- layers --------------------------------------------------------------------------------
class MoEDecoderBlock(DecoderBlock):
    """A decoder block whose routers' choices are saved in forward and replayed in
    recompute; it adds its routers' statistics to ``extras["router_stats"]`` when the call
    wants the router loss (``output_router_logits``).

    ``router_loss`` is False for models whose transformers forward adds no load-balancing
    loss: their routing is replayed all the same.
    """

    router_loss = True
    compile_layer = False  # routing replay has Python side effects: the layer runs eagerly

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: Any, sliding: bool) -> None:
        super().__init__(layer, rotary_emb, config, sliding)
        self.num_routers = install_router_hooks(layer)
        self.top_k = config.num_experts_per_tok
        self.num_experts = getattr(config, "num_experts", None) or config.num_local_experts

    def _replay(self) -> tuple[torch.Tensor, ...] | None:
        return get_recompute_data() if self.num_routers and doing_recompute() else None

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        extras: dict[str, Any],
    ) -> tuple:
        replay = self._replay()
        with _routing_session(replay) as session:
            hidden = self.run_layer(hidden, attention_mask, position_ids)
        if replay is None and self.num_routers:
            save_for_recompute(*session.indices)  # no-op unless RoundPipe keeps a backward
        if self.router_loss and wants_router_loss(extras, self.config):
            stats = add_router_stats(
                extras.get("router_stats"),
                session.logits,
                self.top_k,
                self.num_experts,
                attention_mask,
            )
            extras = {**extras, "router_stats": stats}
        return hidden, attention_mask, position_ids, extras


def wants_router_loss(extras: dict[str, Any], config: Any) -> bool:
    """Whether the call asked for router logits (hence the router loss), as transformers
    decides it: the call's ``output_router_logits``, else the config's."""
    flag = extras.get("output_router_logits")
    return bool(getattr(config, "output_router_logits", False) if flag is None else flag)


class MoEDecoderHead(DecoderHead):
    """Norm + LM head + token loss; passes the router statistics on for the merge."""

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        extras: dict[str, Any],
    ) -> Any:
        loss, logits = self.loss_and_logits(hidden, extras)
        stats = extras.get("router_stats")
        if stats is None:
            return MoeCausalLMOutputWithPast(loss=loss, logits=logits)
        tokens, probs, rows = stats
        return RouterStatsOutput(
            loss=loss, logits=logits, expert_tokens=tokens, expert_probs=probs, routed_rows=rows
        )


# -- the model -------------------------------------------------------------------------------
class MoECausalLMRoundPipe(CausalLMRoundPipe):
    """A causal-LM preset model whose loss adds the router load-balancing loss of the whole
    batch (``router_aux_loss_coef * aux_loss``) when router logits are asked for
    (``output_router_logits=True``, or the config's default), as transformers does.

    The output is transformers' ``MoeCausalLMOutputWithPast`` with ``loss``, ``aux_loss`` and
    ``logits``; ``router_logits`` is not returned (the statistics the loss needs travel
    instead: ``E`` numbers per layer rather than ``tokens x E``). With a ``merge_output`` or a
    ``split_input`` of the caller's own, the per-microbatch :class:`RouterStatsOutput` comes
    back as that merge makes it and no router loss is added.
    """

    summed_fields = ("loss", *STATS_FIELDS)

    def __init__(self, model: nn.Module, config: Any, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        object.__setattr__(self, "_moe_config", config)  # a plain reference, not mirrored

    def couples_microbatches(self, kwargs: dict[str, Any]) -> bool:
        """The router loss needs every microbatch's routing before any gradient is known."""
        return wants_router_loss(kwargs, self._moe_config)

    def finish(self, outputs: Any, kwargs: dict[str, Any]) -> Any:
        """Add the router loss of the merged statistics to the merged token loss."""
        if not isinstance(outputs, RouterStatsOutput):
            return outputs
        cfg = self._moe_config
        num_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        aux = router_aux_loss(
            outputs.expert_tokens, outputs.expert_probs, outputs.routed_rows, num_experts
        )
        loss = outputs.loss
        if loss is not None:
            loss = loss + cfg.router_aux_loss_coef * aux.to(loss.device)
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=outputs.logits)
