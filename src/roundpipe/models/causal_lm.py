"""The RoundPipe model the causal-LM presets return: the loss is the whole batch's.

RoundPipe runs a call as microbatches, and each computes its own loss. A mean per microbatch
does not add up to the batch's mean (microbatches hold different numbers of target tokens),
so before splitting, the target count of the whole batch is put in ``num_items_in_batch``
(unless the caller gave one, which transformers honours the same way): every microbatch then
returns ``sum of its token losses / num_items_in_batch`` and the merged loss is their SUM,
equal to the full-batch loss transformers computes. ``forward_backward`` back-propagates each
microbatch's loss as is, so it needs no division by the number of microbatches either.

A subclass may add a loss over the whole batch after the merge (:meth:`finish`), e.g. the
router load-balancing loss of mixture-of-experts models, which couples all microbatches.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import RoundPipeRuntimeError, RoundPipeTypeError
from ..runtime.batch import merge_microbatches
from ..runtime.run_config import FullRoundPipeRunConfig, RoundPipeRunConfig
from ..wrapping.model import RoundPipe

__all__ = ["CausalLMRoundPipe", "merge_summing", "target_count"]

# Output fields that are sums over the batch: each microbatch holds its share.
SUMMED_FIELDS = ("loss",)


def target_count(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """Number of target tokens of a causal-LM call (``None`` without labels): what
    transformers divides the summed token losses by when given ``num_items_in_batch``.

    Example:
        >>> target_count({"labels": torch.tensor([[5, 6, -100, 7]])})
        tensor(2)
    """
    ignore_index = kwargs.get("ignore_index")
    ignore_index = -100 if ignore_index is None else ignore_index
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:
        labels = kwargs.get("labels")
        if labels is None:
            return None
        shift_labels = labels[..., 1:]  # the last position's target is the ignored padding
    return (shift_labels != ignore_index).sum()


def merge_summing(
    outputs: Sequence[Any], device: torch.device, summed: Sequence[str] = SUMMED_FIELDS
) -> Any:
    """Merge per-microbatch model outputs: the ``summed`` fields added up, the rest as
    RoundPipe merges by default (batched tensors concatenated, ...).

    Example:
        >>> from transformers.modeling_outputs import CausalLMOutputWithPast
        >>> outs = [CausalLMOutputWithPast(loss=torch.tensor(1.0), logits=torch.ones(1, 2))] * 2
        >>> merged = merge_summing(outs, torch.device("cpu"))
        >>> merged.loss, merged.logits.shape
        (tensor(2.), torch.Size([2, 2]))
    """
    first = outputs[0]
    keys = [k for k in summed if first.get(k) is not None]
    totals = {k: torch.stack([o[k] for o in outputs]).sum(0).to(device) for k in keys}
    rest = [type(o)(**{k: v for k, v in o.items() if k not in totals}) for o in outputs]
    merged = merge_microbatches(rest, device)
    return type(first)(**merged, **totals)  # rebuilt: fields back in declaration order


def _default_loss_fn(outputs: Any, labels: Any) -> Any:
    return outputs.loss


class CausalLMRoundPipe(RoundPipe):
    """:class:`~roundpipe.RoundPipe` over a preset's layers, called like the transformers
    model (``input_ids``, ``attention_mask``, ``labels``, ``num_items_in_batch``, ...), whose
    loss is the full batch's loss however the batch is split into microbatches.

    ``return_logits=False`` (with labels) computes the loss without materialising the logits
    (``logits`` is then ``None``): the head runs over chunks of tokens.

    Example:
        >>> import transformers
        >>> from roundpipe import wrap_model_to_roundpipe
        >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2)
        >>> rp = wrap_model_to_roundpipe(transformers.LlamaForCausalLM(cfg), pin_model="off")
        >>> ids = torch.randint(0, 32, (4, 6))
        >>> out = rp(input_ids=ids, labels=ids, return_logits=False)
        >>> out.logits is None, out.loss.shape
        (True, torch.Size([]))
    """

    # -- hooks for subclasses ------------------------------------------------------------
    summed_fields: tuple[str, ...] = SUMMED_FIELDS

    def finish(self, outputs: Any, kwargs: dict[str, Any]) -> Any:
        """Turn the merged outputs into the model's output (a batch-wide loss term goes here)."""
        return outputs

    def couples_microbatches(self, kwargs: dict[str, Any]) -> bool:
        """Whether the loss of this call needs all microbatches at once (see
        :meth:`forward_backward`)."""
        return False

    # -- calls -----------------------------------------------------------------------------
    def prepare_kwargs(
        self, kwargs: dict[str, Any], run_config: RoundPipeRunConfig | None
    ) -> dict[str, Any]:
        """``kwargs`` with ``num_items_in_batch`` set to the whole batch's target count when
        there are labels and the caller set none (not with a custom ``split_input``, which
        must then split or replicate it itself)."""
        if kwargs.get("num_items_in_batch") is not None:
            return kwargs
        split = (run_config or RoundPipeRunConfig()).split_input
        if split is None:
            split = self.model_run_config.split_input
        count = target_count(kwargs) if split is None else None
        return kwargs if count is None else {**kwargs, "num_items_in_batch": count}

    def _merging_config(
        self, run_config: RoundPipeRunConfig | None, kwargs: dict[str, Any]
    ) -> tuple[RoundPipeRunConfig, bool]:
        """The call's config with the summing merge (unless the caller chose a merge), and
        whether it was put in."""
        cfg = copy.copy(run_config) if run_config is not None else RoundPipeRunConfig()
        full = FullRoundPipeRunConfig(cfg, self.model_run_config)
        summing = kwargs.get("num_items_in_batch") is not None or not _has_labels(kwargs)
        if full.merge_output is not True or not summing:
            return cfg, False
        cfg.merge_output = functools.partial(
            merge_summing, device=full.output_device, summed=self.summed_fields
        )
        return cfg, True

    def forward(
        self, *args: Any, roundpipe_run_config: RoundPipeRunConfig | None = None, **kwargs: Any
    ) -> Any:
        """Run the model; the merged ``loss`` is the full batch's (see the module docstring)."""
        kwargs = self.prepare_kwargs(kwargs, roundpipe_run_config)
        cfg, ours = self._merging_config(roundpipe_run_config, kwargs)
        out = super().forward(*args, roundpipe_run_config=cfg, **kwargs)
        return self.finish(out, kwargs) if ours else out

    def forward_backward(
        self,
        input_args: tuple[Any, ...] = (),
        input_kwargs: dict[str, Any] | None = None,
        label: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor | Sequence[torch.Tensor]] | None = None,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig | None = None,
    ) -> Any:
        """Forward, loss and backward; ``loss_fn`` defaults to the model's ``loss``.

        With labels in ``input_kwargs``, each microbatch's ``loss`` is already its share of
        the batch's loss: their sum (returned) is the full-batch loss, do not divide it by
        the number of microbatches. When the loss couples the microbatches (the router loss
        of a mixture-of-experts model), the call runs :meth:`forward` on the whole batch and
        back-propagates ``loss_fn(merged_outputs, label)`` once instead.

        Example:
            >>> import transformers
            >>> from roundpipe import wrap_model_to_roundpipe
            >>> cfg = transformers.Qwen3Config(vocab_size=32, hidden_size=16,
            ...     intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            ...     num_key_value_heads=1, head_dim=8)
            >>> rp = wrap_model_to_roundpipe(transformers.Qwen3ForCausalLM(cfg), pin_model="off")
            >>> ids = torch.randint(0, 32, (4, 6))
            >>> loss = rp.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
        """
        loss_fn = _default_loss_fn if loss_fn is None else loss_fn
        kwargs = self.prepare_kwargs(dict(input_kwargs or {}), run_config)
        if self.couples_microbatches(kwargs):
            return self._forward_then_backward(
                input_args, kwargs, label, loss_fn, return_outputs, run_config
            )
        cfg, _ = self._merging_config(run_config, kwargs)
        return super().forward_backward(input_args, kwargs, label, loss_fn, return_outputs, cfg)

    def _forward_then_backward(
        self,
        input_args: tuple[Any, ...],
        kwargs: dict[str, Any],
        label: Any,
        loss_fn: Callable[[Any, Any], Any],
        return_outputs: bool,
        run_config: RoundPipeRunConfig | None,
    ) -> Any:
        if not torch.is_grad_enabled():
            raise RoundPipeRuntimeError(
                "forward_backward needs gradients enabled (called under torch.no_grad)"
            )
        cfg = copy.copy(run_config) if run_config is not None else RoundPipeRunConfig()
        cfg.requires_grad = True
        out = self.forward(*input_args, roundpipe_run_config=cfg, **kwargs)
        loss = loss_fn(out, label)
        losses = [loss] if isinstance(loss, torch.Tensor) else list(loss)
        if not all(isinstance(v, torch.Tensor) for v in losses):
            raise RoundPipeTypeError("loss_fn must return a tensor or a sequence of tensors")
        torch.autograd.backward([v for v in losses if v.requires_grad])
        total: Any = (
            loss.detach() if isinstance(loss, torch.Tensor) else [v.detach() for v in losses]
        )
        if not return_outputs:
            return total
        return total, pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)


def _has_labels(kwargs: dict[str, Any]) -> bool:
    return kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
