"""The registry of family schedules, keyed by ``model.config.model_type``; every other model gets
the generic plan (:mod:`~slapo.model_schedule.generic_plan`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..exceptions import SlapoError
from ..schedule import Schedule, create_schedule
from .generic_plan import GENERIC_KNOBS, generic_plan
from .knobs import LAYOUT_KNOBS, Knobs, recommended_knobs
from .published import CONTEXT_KNOBS, translate_published_knobs

__all__ = [
    "ScheduleFn",
    "register_schedule",
    "list_families",
    "get_schedule",
    "family_limits",
    "apply_schedule",
]

#: ``fn(sch, knobs)``: apply a family's plan to the root schedule of one of its models.
ScheduleFn = Callable[[Schedule, Knobs], None]


@dataclass(frozen=True)
class _Entry:
    fn: ScheduleFn
    unsupported: Mapping[str, str]


_SCHEDULES: dict[str, _Entry] = {}


def register_schedule(
    *model_types: str, unsupported: Mapping[str, str] | None = None
) -> Callable[[ScheduleFn], ScheduleFn]:
    """Register ``fn(sch, knobs)`` as the schedule of every listed ``config.model_type``.

    ``unsupported``: knob -> why the family cannot do it; :func:`apply_schedule` refuses the knob
    with that reason before the plan runs (so plans hold no copied checks).

    Example:
        >>> @register_schedule("my_llama", unsupported={"fuse_ops": "nothing to fuse"})
        ... def my_llama(sch, knobs):
        ...     helpers.checkpoint_blocks(sch, helpers.blocks(sch, "model.layers"), knobs.ckpt_ratio)
        >>> del _SCHEDULES["my_llama"]  # unregistered again: this was only an example
    """
    if not model_types or not all(isinstance(t, str) and t for t in model_types):
        raise SlapoError("register_schedule needs one or more model_type strings, e.g. 'llama'")
    limits = dict(unsupported or {})
    unknown = sorted(set(limits) - set(Knobs.__dataclass_fields__))
    if unknown:
        raise SlapoError(f"register_schedule: unsupported names unknown knobs {unknown}")

    def decorator(fn: ScheduleFn) -> ScheduleFn:
        for model_type in model_types:
            _SCHEDULES[model_type] = _Entry(fn, limits)
        return fn

    return decorator


def family_limits(family: str | None) -> dict[str, str]:
    """The knobs ``family`` cannot take and why (the generic plan's for None or an unknown one).

    Example:
        >>> "fuse_ops" in family_limits("llama")
        True
    """
    entry = _SCHEDULES.get(family or "")
    return dict(entry.unsupported) if entry is not None else dict(_GENERIC_LIMITS)


_GENERIC_LIMITS = {
    "fuse_ops": "the generic plan fuses nothing (fusions need a family's own plan)",
}


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
            "leave family out for the generic plan, or register one: "
            f"@slapo.model_schedule.register_schedule({family!r}) on a function fn(sch, knobs)"
        )
    return _SCHEDULES[family].fn


def apply_schedule(
    model: nn.Module | Schedule, family: str | None = None, **knobs: Any
) -> Schedule:
    """Schedule a model with its family's ready plan, or the generic plan for any other model;
    returns the root schedule.

    With no knobs but the layout ones (``group``, ``sequence_parallel``, ``num_stages``) it
    applies the *recommended* schedule: the family's best measured knobs
    (:func:`~slapo.model_schedule.knobs.recommended_knobs`; the generic plan's
    :data:`~slapo.model_schedule.generic_plan.GENERIC_KNOBS` otherwise), the whole-model compilation
    left out with tensor or pipeline parallelism. Any other knob given means exact control: the
    knobs not given keep their plain defaults (nothing applied).

    Args:
        model: the model (or its root schedule, created with the TP ``group`` when one is used).
        family: a registered model type; default ``model.config.model_type``, and the generic
            plan when that has no ready schedule.
        **knobs: ``group``, ``sequence_parallel``, ``ckpt_ratio``, ``attn_op``, ``fuse_ops``,
            ``fused_loss``, ``num_stages``; see :class:`~slapo.model_schedule.knobs.Knobs`.
            Published Slapo's ``model_config``, ``prefix``, ``fp16``, ``bf16``,
            ``disable_flash_attn`` and ``attn_op_name`` are taken too
            (:mod:`~slapo.model_schedule.published`).

    Example:
        >>> import slapo
        >>> import transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)
        >>> model = transformers.GPT2LMHeadModel(config)
        >>> sch = apply_schedule(model)                  # the recommended schedule
        >>> sch = apply_schedule(model, ckpt_ratio=0.5)  # exactly this, nothing else
        >>> model, optimizer = slapo.build(sch, init_weights=False)
    """
    choices = set(knobs) - set(CONTEXT_KNOBS)
    knobs, context = translate_published_knobs(_module_of(model), knobs)
    unknown = sorted(set(knobs) - set(Knobs.__dataclass_fields__))
    if unknown:
        raise SlapoError(
            f"apply_schedule got unknown knobs {unknown}; the knobs are "
            f"{', '.join(Knobs.__dataclass_fields__)}"
        )
    sch = _root_schedule(model, knobs.get("group"))
    explicit = family is not None
    if family is None:
        config = getattr(sch.mod, "config", None)
        family = getattr(config, "model_type", None)
    if explicit:
        get_schedule(family)  # a named family must exist
    ready = family in _SCHEDULES
    recommended = not choices - set(LAYOUT_KNOBS)
    if recommended:
        defaults = recommended_knobs(family) if ready else dict(GENERIC_KNOBS)
        if knobs.get("group") is not None or knobs.get("num_stages", 1) > 1:
            defaults.pop("compile_model", None)  # measured on one process, without stages
        knobs = {**defaults, **knobs}
    settings = Knobs(**knobs)
    plain = Knobs()
    for name, reason in family_limits(family if ready else None).items():
        if getattr(settings, name) != getattr(plain, name):  # the knob asks for something
            who = family if ready else f"{type(sch.mod).__name__} (generic plan)"
            raise SlapoError(f"{who}: {name} is not supported: {reason}")
    if ready:
        _SCHEDULES[family].fn(sch, settings)
        info: dict[str, Any] = {"family": family, "plan": "ready"}
    else:
        generic_plan(sch, settings)
        info = {"family": None, **sch.extra.pop("model_schedule_plan")}
    sch.extra["model_schedule"] = {
        **info, "recommended": recommended, **settings.as_dict(), **context
    }  # fmt: skip
    return sch


def _module_of(model: nn.Module | Schedule) -> nn.Module:
    return model.mod if isinstance(model, Schedule) else model


def _root_schedule(model: nn.Module | Schedule, group: Any) -> Schedule:
    if isinstance(model, Schedule):
        if model.parent is not None:
            raise SlapoError(f'apply_schedule needs the root schedule, got "{model.path}"')
        if group is not None and model.group is not group:
            raise SlapoError(
                "apply_schedule: group= differs from the schedule's own group; create the "
                "schedule with create_schedule(model, group=group) or pass the model instead"
            )
        return model
    if isinstance(model, nn.Module):
        return create_schedule(model, group=group)
    raise SlapoError(f"apply_schedule needs an nn.Module or a Schedule, got {type(model).__name__}")
