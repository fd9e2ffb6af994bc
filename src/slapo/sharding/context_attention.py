"""Causal attention over a context-parallel group, as a transformers attention implementation.

:func:`register` adds ``"slapo_cp"`` to transformers' ``AttentionInterface`` (and a matching entry
to ``AttentionMaskInterface``), so every model whose attention modules call
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`` can run it.

Each rank holds its queries, keys and values for its two chunks of the sequence
(:mod:`.context_layout`). The attention all-gathers K and V over the group (the backward
reduce-scatters their gradients back to the owner ranks) and puts them in global order. Without a
padding mask or dropout it then runs mask-free (:mod:`.context_kernels`: per query chunk, a fused
kernel over the fully visible prefix and one over the causal diagonal block, merged by their
log-sum-exps), so the bytes kept for backward stay linear in the sequence. With the user's 2-D
padding mask (gathered the same way) or dropout, it runs SDPA of the local queries against every
key with a dense mask built from global positions.
"""

from __future__ import annotations

import inspect
import weakref
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import all_gather
from .context_kernels import chunked_causal_attention
from .context_layout import (
    ContextParallelError,
    gather_sequence,
    global_order,
    local_chunks,
    local_positions,
)
from .groups import group_rank, group_size

__all__ = ["CP_ATTENTION", "register", "find_attention_modules", "bind_attention"]

CP_ATTENTION = "slapo_cp"

# attention module -> (its path in the model, its cp process group). Weak keys: a module carries
# no reference to a process group (a deepcopy of the model would try to copy it).
_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_USES_INTERFACE: dict[type, bool] = {}
# how many attention calls ran each path ("mask_free" or "dense"): lets tests see which one ran
PATH_CALLS: Counter = Counter()


def _uses_interface(cls: type) -> bool:
    """Whether ``cls.forward`` dispatches through transformers' attention interface."""
    if cls not in _USES_INTERFACE:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        _USES_INTERFACE[cls] = "ALL_ATTENTION_FUNCTIONS" in source
    return _USES_INTERFACE[cls]


def find_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``(path, module)`` of every attention module of ``model`` that context parallelism can
    run; raises :class:`ContextParallelError` naming a module it cannot.

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(
        ...     num_hidden_layers=2, hidden_size=16, intermediate_size=32,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
        ... )
        >>> llama = transformers.LlamaForCausalLM(config)
        >>> [p for p, _ in find_attention_modules(llama)]  # doctest: +SKIP
        ['model.layers.0.self_attn', 'model.layers.1.self_attn']
    """
    found = []
    for path, module in model.named_modules():
        name = type(module).__name__
        if _uses_interface(type(module)):
            if not getattr(module, "is_causal", False):
                raise ContextParallelError(
                    f'"{path}" ({name}) is not causal attention: context parallelism supports '
                    "causal (decoder) self-attention only"
                )
            if getattr(module, "sliding_window", None) is not None:
                raise ContextParallelError(
                    f'"{path}" ({name}) uses sliding-window attention, which context parallelism '
                    "does not support: set config.sliding_window = None (or use_sliding_window=False)"
                )
            found.append((path, module))
        elif "Attention" in name and not any(
            "Attention" in type(m).__name__ for m in module.modules() if m is not module
        ):
            raise ContextParallelError(
                f'"{path}" ({name}) does not run its attention through transformers\' '
                "AttentionInterface (ALL_ATTENTION_FUNCTIONS), so context parallelism cannot "
                "replace it; use a model family whose attention does"
            )
    if not found:
        raise ContextParallelError(
            f"{type(model).__name__} has no attention module that runs through transformers' "
            "AttentionInterface; context parallelism needs one"
        )
    return found


def bind_attention(modules: list[tuple[str, nn.Module]], group: Any) -> None:
    """Record the cp ``group`` that each attention module gathers over."""
    for path, module in modules:
        _BOUND[module] = (path, group)


def _gather_kv(t: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """All-gather (B, H, S_local, D) over the group, in global sequence order; the backward sums
    every rank's gradient of the gathered tensor and keeps the owner's slice."""
    full = all_gather(t, group, dim=2, bwd="reduce_scatter")
    return full.index_select(2, global_order(t.shape[2] // 2, world, t.device))


def cp_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``"slapo_cp"`` attention function (transformers' attention-interface signature)."""
    bound = _BOUND.get(module)
    name = type(module).__name__
    if bound is None:
        raise ContextParallelError(
            f"{name} runs attention {CP_ATTENTION!r} but was not prepared by "
            "slapo.sharding.context_parallel(model, group); call that on the whole model"
        )
    path, group = bound
    for unsupported in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ContextParallelError(
                f'"{path}" ({name}) passes {unsupported}={kwargs[unsupported]!r}, which context '
                "parallelism does not support"
            )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ContextParallelError(
            f'"{path}" ({name}) got a {attention_mask.dim()}-D attention mask; context '
            "parallelism takes the 2-D padding mask (batch, local sequence) of shard_batch"
        )
    world, rank = group_size(group), group_rank(group, path)
    key, value = _gather_kv(key, group, world), _gather_kv(value, group, world)
    if attention_mask is None and dropout == 0.0:
        PATH_CALLS["mask_free"] += 1
        out = chunked_causal_attention(query, key, value, local_chunks(rank, world), scaling)
    else:
        PATH_CALLS["dense"] += 1
        out = _dense_attention(query, key, value, attention_mask, group, rank, world, dropout,
                               scaling)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    group: Any,
    rank: int,
    world: int,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """SDPA of the local queries against every (gathered) key with a dense mask of global
    positions: causal, and the 2-D padding mask gathered over the group. O(S^2 / cp) bytes, for
    what the mask-free path cannot run (padding, dropout)."""
    seq = key.shape[2]
    q_pos = local_positions(seq, rank, world, query.device)
    mask = q_pos[:, None] >= torch.arange(seq, device=query.device)[None, :]  # causal, global
    if attention_mask is not None:
        keep = gather_sequence(attention_mask.to(torch.bool), group, dim=1)  # (B, S) padding
        mask = mask[None, None] & keep[:, None, None, :]
    if key.shape[1] != query.shape[1]:  # grouped-query attention: gathered before repeating
        repeat = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(repeat, dim=1)
        value = value.repeat_interleave(repeat, dim=1)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )


def cp_mask(*, attention_mask: torch.Tensor | None = None, **_: Any) -> torch.Tensor | None:
    """Mask creation for ``"slapo_cp"``: pass the 2-D padding mask through (the attention builds
    the causal part from global positions); None when there is no padding."""
    return attention_mask


def register() -> None:
    """Register ``"slapo_cp"`` with transformers' attention and attention-mask interfaces.

    Example:
        >>> register()
        >>> from transformers import AttentionInterface
        >>> CP_ATTENTION in AttentionInterface()
        True
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CP_ATTENTION, cp_attention_forward)
    AttentionMaskInterface.register(CP_ATTENTION, cp_mask)
