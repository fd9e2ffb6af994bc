"""Context parallelism (CP): every rank of a cp group holds a slice of each sequence.

A training step with a transformers causal LM:

.. code-block:: python

    cp = context_parallel(model, group)      # attention runs over the group from now on
    local = cp.shard_batch(batch)            # this rank's tokens, positions and shifted labels
    labels = local.pop("shift_labels")
    loss = cp.loss(model(**local).logits, labels)   # the full-sequence mean loss, on every rank
    loss.backward()
    all_reduce_grads(model, group)           # sum the parameters' partial gradients over cp

The sequence layout is load-balanced (:mod:`.context_layout`); the attention all-gathers K and V
(:mod:`.context_attention`), as Llama 3 was trained: with grouped-query attention K and V are
small next to Q and one all-gather is one collective per layer. Without padding, each local query
chunk attends its fully visible prefix and its causal diagonal block with fused kernels, merged
by their log-sum-exps (:mod:`.context_kernels`): linear memory in the sequence. A padding mask
takes a dense (local queries x all keys) mask over global positions instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .collectives import _record, all_reduce, run_collective
from .context_attention import CP_ATTENTION, bind_attention, find_attention_modules, register
from .context_layout import (
    ContextParallelError,
    check_divisible,
    gather_sequence,
    local_positions,
    split_sequence,
)
from .groups import group_rank, group_size, require_initialized, resolve_group

__all__ = [
    "ContextParallel",
    "ContextParallelError",
    "all_reduce_grads",
    "context_parallel",
    "context_parallel_loss",
]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ContextParallel:
    """What a training step needs from a model prepared by :func:`context_parallel`."""

    group: Any  # the resolved ProcessGroup (None: the default group)
    rank: int
    world: int

    def shard_batch(self, batch: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """This rank's part of a full batch ``{input_ids, labels?, attention_mask?,
        position_ids?}`` of shape (batch, sequence).

        Returns ``input_ids`` and ``position_ids`` (global positions of the local tokens), the
        local ``attention_mask`` if one was given, and ``shift_labels``: the labels shifted by one
        over the *full* sequence (the label of each local token is the next global token), with
        -100 after the last token, ready for :meth:`loss`.

        Example:
            >>> import transformers
            >>> from slapo.sharding import init_parallel_mesh
            >>> config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
            ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
            >>> model = transformers.LlamaForCausalLM(config)
            >>> ids = torch.randint(0, 32, (1, 8))
            >>> # on each rank of a 2-rank context-parallel job (torchrun): not run here
            >>> mesh = init_parallel_mesh("cpu", cp=2)  # doctest: +SKIP
            >>> group = mesh["cp"]  # doctest: +SKIP
            >>> cp = context_parallel(model, group=group)  # doctest: +SKIP
            >>> local = cp.shard_batch({"input_ids": ids, "labels": ids})  # doctest: +SKIP
        """
        unknown = set(batch) - {"input_ids", "labels", "attention_mask", "position_ids"}
        if unknown:
            raise ContextParallelError(
                f"shard_batch: unsupported batch keys {sorted(unknown)}; it shards input_ids, "
                "labels, attention_mask and position_ids"
            )
        ids = batch["input_ids"]
        seq = ids.shape[1]
        check_divisible(seq, self.world, "shard_batch: ")
        positions = torch.arange(seq, device=ids.device).expand(ids.shape[0], seq)
        given = batch.get("position_ids")
        if given is not None and not torch.equal(given.expand_as(positions), positions):
            raise ContextParallelError(
                "shard_batch: position_ids other than 0..seq-1 per row (e.g. packed sequences) "
                "are not supported by context parallelism; drop position_ids"
            )
        out = {
            "input_ids": self.split(ids),
            "position_ids": self.split(positions),
        }
        if batch.get("attention_mask") is not None:
            out["attention_mask"] = self.split(batch["attention_mask"])
        labels = batch.get("labels")
        if labels is not None:
            shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            out["shift_labels"] = self.split(shifted)
        return out

    def model_batch(self, batch: Mapping[str, torch.Tensor | None]) -> dict[str, Any]:
        """This rank's keyword arguments for a transformers causal LM that computes its own loss
        from a full batch ``{input_ids, labels, attention_mask?}``, for data parallelism over
        dp x cp ranks that *averages* their gradients and losses (DDP, FSDP).

        The model's loss (transformers' ``ForCausalLMLoss``) then reads ``shift_labels`` (the
        labels shifted over the full sequence, this rank's part) and divides this rank's summed
        token losses by ``num_items_in_batch`` = the sequence's valid labels / cp: the mean of
        that over the cp ranks is the full sequence's mean loss, so averaging the cp ranks'
        gradients gives the full sequence's gradient.

        Example:
            >>> import transformers
            >>> from slapo.sharding import init_parallel_mesh
            >>> config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
            ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
            >>> model = transformers.LlamaForCausalLM(config)
            >>> ids = torch.randint(0, 32, (1, 8))
            >>> # on each rank of a 2-rank context-parallel job (torchrun): not run here
            >>> mesh = init_parallel_mesh("cpu", cp=2)  # doctest: +SKIP
            >>> group = mesh["cp"]  # doctest: +SKIP
            >>> cp = context_parallel(model, group=group)  # doctest: +SKIP
            >>> out = model(**cp.model_batch({"input_ids": ids, "labels": ids}))  # doctest: +SKIP
        """
        if batch.get("labels") is None:
            raise ContextParallelError(
                "model_batch: the batch needs labels (the model computes its loss from them); "
                "without a loss use shard_batch"
            )
        local = self.shard_batch(batch)
        shifted = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
        count = (shifted != IGNORE_INDEX).sum().to(torch.float32)
        if count == 0:
            raise ContextParallelError("model_batch: every label of the batch is -100")
        labels = local.pop("shift_labels")
        # labels= only switches the model's loss on: shift_labels= is what it reads
        return {**local, "labels": labels, "shift_labels": labels,
                "num_items_in_batch": count / self.world}  # fmt: skip

    def split(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's load-balanced slice of ``t`` along ``dim``."""
        return split_sequence(t, self.rank, self.world, dim)

    def positions(self, seq_len: int, device: Any = None) -> torch.Tensor:
        """Global positions of this rank's tokens in a sequence of ``seq_len``."""
        return local_positions(seq_len, self.rank, self.world, device)

    def gather(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full sequence of a local tensor, in global order (no gradient)."""
        return gather_sequence(t, self.group, dim)

    def loss(self, logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        """The full-sequence mean cross-entropy; see :func:`context_parallel_loss`."""
        return context_parallel_loss(logits, shift_labels, self.group)


def context_parallel(model: nn.Module, group: Any = None) -> ContextParallel:
    """Run ``model``'s attention over the cp ``group`` and return what shards its batches.

    ``model``: a transformers causal LM whose attention goes through ``AttentionInterface``
    (Llama, Qwen2, ...); grouped-query attention works. A non-causal model, sliding-window
    attention or attention outside the interface raise :class:`ContextParallelError`.

    Example:
        >>> import transformers
        >>> from slapo.sharding import init_parallel_mesh
        >>> config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> ids = torch.randint(0, 32, (1, 8))
        >>> # on each rank of a 2-rank context-parallel job (torchrun): not run here
        >>> mesh = init_parallel_mesh("cpu", cp=2)  # doctest: +SKIP
        >>> group = mesh["cp"]  # doctest: +SKIP
        >>> cp = context_parallel(model, group=mesh["cp"])  # doctest: +SKIP
        >>> batch = {"input_ids": ids, "labels": ids}
        >>> local = cp.shard_batch(batch)  # doctest: +SKIP
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ContextParallelError(
            f"context_parallel: {type(model).__name__} is not a transformers PreTrainedModel; "
            "context parallelism replaces its attention through config._attn_implementation"
        )
    if getattr(config, "sliding_window", None) is not None:
        raise ContextParallelError(
            f"context_parallel: {type(model).__name__} uses sliding-window attention "
            f"(config.sliding_window={config.sliding_window}), which context parallelism does not "
            "support; set config.sliding_window = None"
        )
    modules = find_attention_modules(model)
    require_initialized("context_parallel")
    pg = resolve_group(group, "context_parallel")
    rank, world = group_rank(pg, "context_parallel"), group_size(pg)
    register()
    model.set_attn_implementation(CP_ATTENTION)
    if config._attn_implementation != CP_ATTENTION:
        raise ContextParallelError(
            f"context_parallel: transformers refused to set attention {CP_ATTENTION!r} on "
            f"{type(model).__name__} (it does not follow the AttentionInterface)"
        )
    bind_attention(modules, pg)
    return ContextParallel(pg, rank, world)


def context_parallel_loss(
    logits: torch.Tensor, shift_labels: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """Mean cross-entropy over every valid label of the full sequence, on every rank.

    Each rank sums its tokens' losses and divides by the global number of valid labels (-100 is
    ignored); the forward sums that over the group. The backward passes the gradient through
    unchanged, so each rank differentiates exactly its own tokens' share.

    Example:
        >>> import transformers
        >>> from slapo.sharding import init_parallel_mesh
        >>> config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> ids = torch.randint(0, 32, (1, 8))
        >>> # on each rank of a 2-rank context-parallel job (torchrun): not run here
        >>> mesh = init_parallel_mesh("cpu", cp=2)  # doctest: +SKIP
        >>> group = mesh["cp"]  # doctest: +SKIP
        >>> cp = context_parallel(model, group=group)  # doctest: +SKIP
        >>> local = cp.shard_batch({"input_ids": ids, "labels": ids})  # doctest: +SKIP
        >>> out = model(input_ids=local["input_ids"], position_ids=local["position_ids"])  # doctest: +SKIP
        >>> loss = context_parallel_loss(out.logits, local["shift_labels"], group)  # doctest: +SKIP
    """
    pg = resolve_group(group, "context_parallel_loss")
    local_sum = F.cross_entropy(
        logits.float().flatten(0, -2),
        shift_labels.flatten().to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    count = (shift_labels != IGNORE_INDEX).sum().to(local_sum)
    count = all_reduce(count, pg)  # no gradient flows into a count
    return all_reduce(local_sum / count, pg)


def all_reduce_grads(model: nn.Module, group: Any = None) -> int:
    """Sum every parameter's gradient over the cp ``group`` (one collective per dtype); returns
    how many gradients were summed. Call it after ``backward`` and before the optimizer step.

    Example:
        >>> import transformers
        >>> from slapo.sharding import init_parallel_mesh
        >>> config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> ids = torch.randint(0, 32, (1, 8))
        >>> # on each rank of a 2-rank context-parallel job (torchrun): not run here
        >>> mesh = init_parallel_mesh("cpu", cp=2)  # doctest: +SKIP
        >>> group = mesh["cp"]  # doctest: +SKIP
        >>> cp = context_parallel(model, group=group)  # doctest: +SKIP
        >>> local = cp.shard_batch({"input_ids": ids, "labels": ids})  # doctest: +SKIP
        >>> out = model(input_ids=local["input_ids"], position_ids=local["position_ids"])  # doctest: +SKIP
        >>> loss = cp.loss(out.logits, local["shift_labels"])  # doctest: +SKIP
        >>> loss.backward(); all_reduce_grads(model, group)  # doctest: +SKIP
    """
    pg = resolve_group(group, "all_reduce_grads")
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in model.parameters():
        if param.grad is not None:
            by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        _record("bwd", "all_reduce")
        run_collective("all_reduce", pg, lambda flat=flat: dist.all_reduce(flat, group=pg))
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return sum(len(grads) for grads in by_dtype.values())
