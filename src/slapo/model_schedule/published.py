"""The knobs published Slapo's ``apply_schedule`` took, translated into ours, so that a call copied
from its tutorials (``apply_schedule(model, "bert", model_config=config, prefix="bert",
fp16=True, ckpt_ratio=0)``) runs unchanged.

Some of them only described the model to a plan that could not find it out itself: ``model_config``
(ours reads ``model.config``), ``prefix`` (the backbone's path; our plans find their blocks) and
``fp16``/``bf16`` (the precision the model will train in; our schedules equal the model in every
precision, and the precision is chosen at ``slapo.build(..., precision=)``). These are checked
against the model and recorded, never silently taken for something else. The attention ones map
onto :attr:`~slapo.model_schedule.knobs.Knobs.attn_op`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..exceptions import SlapoError

__all__ = ["CONTEXT_KNOBS", "translate_published_knobs"]

#: Published knobs that describe the model rather than choose an optimization: giving them keeps
#: the recommended schedule (as the layout knobs do).
CONTEXT_KNOBS = ("model_config", "prefix", "fp16", "bf16")

#: Published attention kernel names (``FlashAttentionOp``'s) -> ours.
_ATTN_OP_NAMES = {"cuda": "flash", "triton": "flash", "native_xformers": "sdpa", "cutlass": "sdpa"}


def translate_published_knobs(model: nn.Module, knobs: dict[str, Any]) -> tuple[dict, dict]:
    """Split ``knobs`` into ours (published attention names translated) and the context they
    gave (``{"precision": "fp16", "prefix": "bert"}``), after checking that context against the
    model.

    Example:
        >>> translate_published_knobs(nn.Linear(2, 2), {"fp16": True, "ckpt_ratio": 0})
        ({'ckpt_ratio': 0}, {'precision': 'fp16'})
    """
    knobs = dict(knobs)
    context: dict[str, Any] = {}
    config = knobs.pop("model_config", None)
    if config is not None and not _same_config(config, getattr(model, "config", None)):
        raise SlapoError(
            f"apply_schedule: model_config is not the config of the {type(model).__name__} "
            "being scheduled; pass model.config (or leave model_config out: it is read from "
            "the model)"
        )
    prefix = knobs.pop("prefix", None)
    if prefix:
        try:
            model.get_submodule(prefix)
        except AttributeError as err:
            raise SlapoError(
                f"apply_schedule: prefix={prefix!r} names no submodule of "
                f"{type(model).__name__}; give the path of the backbone (e.g. 'bert') or ''"
            ) from err
        context["prefix"] = prefix
    fp16, bf16 = bool(knobs.pop("fp16", False)), bool(knobs.pop("bf16", False))
    if fp16 and bf16:
        raise SlapoError("apply_schedule: fp16=True and bf16=True exclude each other; pick one")
    if fp16 or bf16:
        context["precision"] = "fp16" if fp16 else "bf16"
    if knobs.pop("disable_flash_attn", False):
        knobs.setdefault("attn_op", None)
    name = knobs.pop("attn_op_name", None)
    if name is not None:
        if name not in _ATTN_OP_NAMES:
            raise SlapoError(
                f"apply_schedule: attn_op_name={name!r} is not one of {sorted(_ATTN_OP_NAMES)}; "
                "or pass attn_op= one of 'eager', 'sdpa', 'flash'"
            )
        op = _ATTN_OP_NAMES[name]
        knobs["attn_op"] = op if op != "flash" or torch.cuda.is_available() else "sdpa"
    return knobs, context


def _same_config(given: Any, own: Any) -> bool:
    if given is own:
        return True
    to_dict = getattr(given, "to_dict", None)
    return own is not None and callable(to_dict) and to_dict() == own.to_dict()
