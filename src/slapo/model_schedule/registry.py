"""The registry of family schedules, keyed by ``model.config.model_type``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..exceptions import SlapoError
from ..schedule import Schedule, create_schedule
from .knobs import Knobs

__all__ = ["ScheduleFn", "register_schedule", "list_families", "get_schedule", "apply_schedule"]

#: ``fn(sch, knobs)``: apply a family's plan to the root schedule of one of its models.
ScheduleFn = Callable[[Schedule, Knobs], None]

_SCHEDULES: dict[str, ScheduleFn] = {}


def register_schedule(*model_types: str) -> Callable[[ScheduleFn], ScheduleFn]:
    """Register ``fn(sch, knobs)`` as the schedule of every listed ``config.model_type``.

    Example:
        >>> @register_schedule("my_llama")
        ... def my_llama(sch, knobs):
        ...     helpers.checkpoint_blocks(sch, helpers.blocks(sch, "model.layers"), knobs.ckpt_ratio)
    """
    if not model_types or not all(isinstance(t, str) and t for t in model_types):
        raise SlapoError("register_schedule needs one or more model_type strings, e.g. 'llama'")

    def decorator(fn: ScheduleFn) -> ScheduleFn:
        for model_type in model_types:
            _SCHEDULES[model_type] = fn
        return fn

    return decorator


def list_families() -> list[str]:
    """Every registered model type, sorted.

    Example:
        >>> "llama" in list_families()
        True
    """
    return sorted(_SCHEDULES)


def get_schedule(family: str) -> ScheduleFn:
    """The schedule function of ``family``; a clear error lists the known ones."""
    if family not in _SCHEDULES:
        raise SlapoError(
            f"no ready schedule for model type {family!r}; known families: "
            f"{', '.join(list_families())}. Pass family= one of them when the layout matches, "
            "or register one: @slapo.model_schedule.register_schedule("
            f"{family!r}) on a function fn(sch, knobs)"
        )
    return _SCHEDULES[family]


def apply_schedule(
    model: nn.Module | Schedule, family: str | None = None, **knobs: Any
) -> Schedule:
    """Schedule a transformers model with its family's ready plan; returns the root schedule.

    Args:
        model: the model (or its root schedule, created with the TP ``group`` when one is used).
        family: a registered model type; default ``model.config.model_type``.
        **knobs: ``group``, ``sequence_parallel``, ``ckpt_ratio``, ``attn_op``, ``fuse_ops``,
            ``fused_loss``, ``num_stages``; see :class:`~slapo.model_schedule.knobs.Knobs`.

    Example:
        >>> sch = apply_schedule(model, ckpt_ratio=0.5)
        >>> model, optimizer = slapo.build(sch, init_weights=False)
    """
    unknown = sorted(set(knobs) - set(Knobs.__dataclass_fields__))
    if unknown:
        raise SlapoError(
            f"apply_schedule got unknown knobs {unknown}; the knobs are "
            f"{', '.join(Knobs.__dataclass_fields__)}"
        )
    settings = Knobs(**knobs)
    if isinstance(model, Schedule):
        if model.parent is not None:
            raise SlapoError(f'apply_schedule needs the root schedule, got "{model.path}"')
        sch = model
        if settings.group is not None and sch.group is not settings.group:
            raise SlapoError(
                "apply_schedule: group= differs from the schedule's own group; create the "
                "schedule with create_schedule(model, group=group) or pass the model instead"
            )
    elif isinstance(model, nn.Module):
        sch = create_schedule(model, group=settings.group)
    else:
        raise SlapoError(
            f"apply_schedule needs an nn.Module or a Schedule, got {type(model).__name__}"
        )
    if family is None:
        config = getattr(sch.mod, "config", None)
        family = getattr(config, "model_type", None)
        if family is None:
            raise SlapoError(
                f"apply_schedule: {type(sch.mod).__name__} has no config.model_type; pass "
                f"family= one of {', '.join(list_families())}"
            )
    get_schedule(family)(sch, settings)
    sch.extra["model_schedule"] = {"family": family, **settings.as_dict()}
    return sch
