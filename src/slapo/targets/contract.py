"""The training-loop contract: one loop trains the model that ``slapo.build`` made, for any target.

.. code-block:: python

    model, optimizer = slapo.build(sch, target=..., optimizer=torch.optim.AdamW, ...)
    for batch in batches:
        loss = slapo.train_step(model, batch)   # forward and backward of one batch
        optimizer.step()
        optimizer.zero_grad()

Every target honours it ("eager", "ddp", "fsdp", "pipeline", "roundpipe", "deepspeed"):

* :func:`train_step` runs the built model's own ``train_step(batch)`` when it has one: the
  pipeline engine runs its schedule over every stage and microbatch and returns the mean loss on
  every rank; DeepSpeed's engine runs forward and ``engine.backward(loss)`` (or its pipeline
  schedule without the optimizer step). Otherwise it runs one forward and ``loss.backward()``.
* In float16 (``slapo.build(..., precision="fp16")``) it scales the loss before the backward
  with the model's loss scaler, and the optimizer ``build`` returns unscales the gradients and
  skips a step that overflowed (:mod:`slapo.targets.mixed_precision`); the loss it returns is
  unscaled. bfloat16 and float32 need no scaling.
* The optimizer ``build`` returns applies what the backward left: a torch optimizer, for
  RoundPipe the wrapper that steps RoundPipe's optimizer copies, for DeepSpeed the wrapper whose
  ``step()`` is DeepSpeed's step.
* Whatever a target does around backward (the gradient all-reduce of ddp and fsdp, the sum of
  weights tied across pipeline stages, RoundPipe's gradient streaming) happens inside its model
  or optimizer, never in the loop: the loop names no target.
* Where a forward returns the loss (eager, ddp, fsdp, roundpipe, deepspeed with ZeRO 1-3), the
  ordinary ``model(**batch).loss.backward(); optimizer.step()`` trains as well.

A batch is one of:

* a mapping: the forward's keyword arguments, ``model(**batch)``; the loss is the output's
  ``loss`` (e.g. a Hugging Face model given ``labels``). With ``loss_fn``, the ``labels`` entry is
  the target and stays out of the forward: ``loss_fn(model(**rest), batch["labels"])``.
* a tuple or list: positional arguments, ``model(*batch)``; with ``loss_fn``, the last item is the
  target: ``loss_fn(model(*batch[:-1]), batch[-1])``.
* a tensor: ``model(batch)``.

The pipeline engine reads the same batches (a mapping's inputs by the forward's parameter names)
and applies the ``loss_fn`` given to ``build``, as the ``"deepspeed"`` target does; DeepSpeed's
own loop (``engine.backward(loss); engine.step()``) trains its engine as well.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..exceptions import TargetError
from .mixed_precision import GRAD_SCALER_ATTR

__all__ = ["Batch", "LossFn", "TARGET_KEY", "output_loss", "split_batch", "train_step"]

Batch = Mapping[str, Any] | Sequence[Any] | torch.Tensor
LossFn = Callable[[Any, Any], torch.Tensor]  # (model output, target) -> scalar loss

TARGET_KEY = "labels"  # a mapping batch's target when a loss_fn computes the loss


def split_batch(batch: Batch, with_target: bool) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """``(args, kwargs, target)`` of a batch; ``target`` is None unless ``with_target``.

    Example:
        >>> ids, x, y = torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 4), torch.zeros(2)
        >>> split_batch({"input_ids": ids, "labels": ids}, with_target=True)[1].keys()
        dict_keys(['input_ids'])
        >>> split_batch((x, y), with_target=True)[0] == (x,)
        True
    """
    if isinstance(batch, torch.Tensor):
        if with_target:
            raise TargetError(
                "a loss_fn needs the batch's target: pass (inputs..., target) or a mapping "
                f'with a "{TARGET_KEY}" entry, not one tensor'
            )
        return (batch,), {}, None
    if isinstance(batch, Mapping):
        kwargs = dict(batch)
        if not with_target:
            return (), kwargs, None
        if TARGET_KEY not in kwargs:
            raise TargetError(
                f'a loss_fn needs the batch\'s target: the batch has no "{TARGET_KEY}" entry '
                f"(it has {sorted(kwargs)})"
            )
        target = kwargs.pop(TARGET_KEY)
        return (), kwargs, target
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        items = tuple(batch)
        if not with_target:
            return items, {}, None
        if len(items) < 2:
            raise TargetError(
                f"a loss_fn needs the batch's target as its last item: (inputs..., target); "
                f"got {len(items)} item(s)"
            )
        return items[:-1], {}, items[-1]
    raise TargetError(
        f"a batch is a mapping of keyword arguments, a tuple of positional ones or a tensor; "
        f"got {type(batch).__name__}"
    )


def output_loss(out: Any) -> torch.Tensor:
    """The loss a model returned: ``out.loss``, ``out["loss"]``, or ``out`` when it is a scalar.

    Example:
        >>> output_loss(torch.tensor(2.0))
        tensor(2.)
    """
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor) and out.dim() == 0:
        loss = out
    if not isinstance(loss, torch.Tensor):
        raise TargetError(
            f"the model's output ({type(out).__name__}) carries no loss: give the batch the "
            f'"{TARGET_KEY}" the model computes its loss from, or pass loss_fn=(output, target)'
        )
    return loss


def train_step(model: Any, batch: Batch, loss_fn: LossFn | None = None) -> torch.Tensor:
    """One forward and backward of ``batch`` on a built model, for every target; returns the loss
    (detached). The optimizer's ``step()`` and ``zero_grad()`` follow.

    Args:
        model: what ``slapo.build`` returned.
        batch: a mapping of keyword arguments, a tuple of positional ones, or a tensor (see
            :mod:`slapo.targets.contract`).
        loss_fn: ``loss_fn(output, target)``; default: the loss in the model's output. A model
            with its own ``train_step`` (the pipeline engine) takes its loss_fn at build.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)
        >>> gpt2 = transformers.GPT2LMHeadModel(config)
        >>> import slapo
        >>> sch, target = slapo.create_schedule(gpt2), "eager"
        >>> ids = torch.randint(0, 50257, (2, 8))
        >>> model, opt = slapo.build(sch, target=target, optimizer=torch.optim.AdamW)
        >>> loss = slapo.train_step(model, {"input_ids": ids, "labels": ids})
        >>> opt.step(); opt.zero_grad()
    """
    own_step = getattr(model, "train_step", None)
    if callable(own_step):
        if loss_fn is not None:
            raise TargetError(
                f"{type(model).__name__} runs its own train_step with the loss_fn given to "
                "slapo.build: pass loss_fn= there, not to train_step"
            )
        return own_step(batch).detach()
    args, kwargs, target = split_batch(batch, with_target=loss_fn is not None)
    out = model(*args, **kwargs)
    loss = output_loss(out) if loss_fn is None else loss_fn(out, target)
    scaler = getattr(model, GRAD_SCALER_ATTR, None)  # float16: the optimizer unscales
    (loss if scaler is None else scaler.scale(loss)).backward()
    return loss.detach()
