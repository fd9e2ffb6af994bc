"""The generic plan: the schedule of a model whose type has no ready schedule.

Its blocks are the modules of the classes transformers keeps whole (``_no_split_modules``), or
else the children of the longest list of modules of one class; the plan checkpoints the first
``ckpt_ratio`` of them and applies the other knobs every family shares (attention kernel,
selective policy, compilation). Tensor parallelism and fusions need a family's own plan.

Example:
    >>> sch = generic_schedule(model, ckpt_ratio=0.5)
    >>> describe_plan(sch)
    'generic plan: 2 of 4 blocks (Phi3DecoderLayer, from _no_split_modules) checkpointed'
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ..model_schedule.helpers import apply_shared_knobs
from ..model_schedule.knobs import Knobs
from ..schedule import Schedule, create_schedule
from .config import InputError

__all__ = ["GENERIC_KNOBS", "check_knobs", "describe_plan", "find_blocks", "generic_schedule"]

#: The generic plan's default knobs: half the blocks fully recomputed, nothing compiled (no
#: measurement backs more for an architecture the plan has never seen).
GENERIC_KNOBS: dict[str, Any] = {"ckpt_ratio": 0.5}
#: Knobs that need a family's own plan, and the flag that sets each.
UNSUPPORTED = {
    "group": "--tp",
    "sequence_parallel": "--sequence-parallel",
    "fuse_ops": "--fuse-ops",
    "fused_loss": "--fused-loss",
}


def find_blocks(model: nn.Module) -> tuple[list[str], str]:
    """The paths of ``model``'s repeated blocks, in order, and where they came from.

    Example:
        >>> find_blocks(phi3)
        (['model.layers.0', ..., 'model.layers.3'], 'Phi3DecoderLayer, from _no_split_modules')
    """
    keep_whole = set(getattr(model, "_no_split_modules", None) or ())
    paths: list[str] = []
    for path, module in model.named_modules():
        inside = any(path.startswith(p + ".") for p in paths)
        if type(module).__name__ in keep_whole and path and not inside:
            paths.append(path)
    if paths:
        classes = sorted({type(model.get_submodule(p)).__name__ for p in paths})
        return paths, f"{', '.join(classes)}, from _no_split_modules"
    best: tuple[str, nn.ModuleList] | None = None
    for path, module in model.named_modules():
        kinds = {type(child) for child in module.children()}
        if isinstance(module, nn.ModuleList) and len(kinds) == 1 and len(module) > 1:
            if best is None or len(module) > len(best[1]):
                best = (path, module)
    if best is None:
        return [], "no repeated blocks found"
    path, blocks = best
    return [f"{path}.{i}" for i in range(len(blocks))], (
        f"{type(blocks[0]).__name__}, the longest repeated list"
    )


def check_knobs(knobs: dict[str, Any]) -> None:
    """Raise an :class:`InputError` naming the flag of a knob only a family's plan implements.

    Example:
        >>> check_knobs({"fuse_ops": True})
        Traceback (most recent call last):
        InputError: --fuse-ops: the generic plan ...
    """
    for name, flag in UNSUPPORTED.items():
        if knobs.get(name):
            raise InputError(
                f"{flag}: the generic plan (for model types without a ready schedule) does not "
                "implement it; drop the flag, or use a family with a ready schedule"
            )


def generic_schedule(model: nn.Module, **knobs: Any) -> Schedule:
    """Schedule ``model`` with the generic plan; ``knobs`` as ``apply_schedule`` takes them.

    Raises an :class:`InputError` for a knob only a family's plan implements.
    """
    check_knobs(knobs)
    settings = Knobs(**knobs)
    sch = create_schedule(model)
    paths, source = find_blocks(model)
    if not paths:
        raise InputError(
            f"the generic plan found no blocks in {type(model).__name__} (no _no_split_modules, "
            "no list of like modules) to checkpoint; train it with --unscheduled"
        )
    apply_shared_knobs(sch, settings, paths, head="", shift=True)
    sch.extra["model_schedule"] = {
        "family": None,
        "plan": "generic",
        "blocks": len(paths),
        "checkpointed": math.ceil(settings.ckpt_ratio * len(paths)),
        "block_source": source,
        **settings.as_dict(),
    }
    return sch


def describe_plan(sch: Schedule) -> str:
    """The plan a schedule was made with, in words, for the run summary.

    Example:
        >>> describe_plan(apply_schedule(llama, ckpt_ratio=0.5))
        'ready schedule of llama'
    """
    info = sch.extra.get("model_schedule")
    if info is None:
        return "none (unscheduled)"
    if info.get("plan") == "generic":
        return (
            f"generic plan: {info['checkpointed']} of {info['blocks']} blocks "
            f"({info['block_source']}) checkpointed"
        )
    return f"ready schedule of {info['family']}"
