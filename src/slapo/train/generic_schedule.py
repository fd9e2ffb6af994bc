"""The main job's side of the generic plan (:mod:`slapo.model_schedule.generic_plan`): a model type
without a ready schedule is scheduled with it, and a flag it cannot take fails before any
training, naming the flag.

Example:
    >>> from slapo.train.generic_schedule import describe_plan, generic_schedule
    >>> import transformers
    >>> config = transformers.Phi3Config(
    ...     num_hidden_layers=4, hidden_size=16, intermediate_size=32, num_attention_heads=2,
    ...     num_key_value_heads=2, vocab_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ... )
    >>> model = transformers.Phi3ForCausalLM(config)
    >>> sch = generic_schedule(model, ckpt_ratio=0.5)
    >>> describe_plan(sch)
    'generic plan: 2 of 4 blocks (Phi3DecoderLayer, from _no_split_modules) checkpointed'
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ..exceptions import InputError, SlapoError
from ..model_schedule import GENERIC_KNOBS, apply_schedule, family_limits, find_blocks
from ..schedule import Schedule

__all__ = ["GENERIC_KNOBS", "check_knobs", "describe_plan", "find_blocks", "generic_schedule"]

#: The flag of each knob, for the messages.
_FLAGS = {
    "group": "--tp",
    "sequence_parallel": "--sequence-parallel",
    "fuse_ops": "--fuse-ops",
    "fused_loss": "--fused-loss",
}


def check_knobs(knobs: dict[str, Any]) -> None:
    """Raise an :class:`InputError` naming the flag of a knob the generic plan cannot take.

    Example:
        >>> check_knobs({"fuse_ops": True})
        Traceback (most recent call last):
        slapo.exceptions.InputError: --fuse-ops: the generic plan ...
    """
    for name, reason in family_limits(None).items():
        if knobs.get(name):
            flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
            raise InputError(
                f"{flag}: the generic plan (for model types without a ready schedule) cannot "
                f"take it: {reason}; drop the flag, or use a family with a ready schedule"
            )


def generic_schedule(model: nn.Module, **knobs: Any) -> Schedule:
    """Schedule ``model`` with the generic plan; ``knobs`` as ``apply_schedule`` takes them.

    Raises an :class:`InputError` for a knob the generic plan cannot take or a model it cannot
    place.
    """
    check_knobs(knobs)
    if not knobs:
        knobs = dict(GENERIC_KNOBS)
    try:
        return apply_schedule(model, **knobs)
    except SlapoError as exc:
        raise InputError(str(exc)) from exc


def describe_plan(sch: Schedule) -> str:
    """The plan a schedule was made with, in words, for the run summary.

    Example:
        >>> import transformers
        >>> from slapo.model_schedule import apply_schedule
        >>> config = transformers.LlamaConfig(
        ...     num_hidden_layers=1, hidden_size=16, intermediate_size=32,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
        ... )
        >>> llama = transformers.LlamaForCausalLM(config)
        >>> describe_plan(apply_schedule(llama, ckpt_ratio=0.5))
        'ready schedule of llama'
    """
    info = sch.extra.get("model_schedule")
    if info is None:
        return "none (unscheduled)"
    if info.get("plan") == "generic":
        checkpointed = math.ceil(info["ckpt_ratio"] * info["blocks"])
        text = (
            f"generic plan: {checkpointed} of {info['blocks']} blocks "
            f"({info['block_source']}) checkpointed"
        )
        if info.get("tp_plan"):
            text += f"; tensor parallelism from {info['tp_plan']}"
        return text
    return f"ready schedule of {info['family']}"
