"""The registry of build targets, keyed by target name: one :class:`TargetRecord` each.

A target is a builder ``fn(sch, **options) -> (model, optimizer)`` that honours the training-loop
contract of :mod:`slapo.targets.contract`, registered with what everyone else needs to know of
it: whether it needs ``torch.distributed``, which precisions it trains in, where it keeps the
model state, how the memory planner models it. ``get_dialect_cls(cls_type, target)`` and
``init_target_engine`` are the seed API: the one kind of dialect is ``"runtime_engine"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..exceptions import TargetError

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = [
    "DIALECT_KINDS",
    "Builder",
    "TargetRecord",
    "get_dialect_cls",
    "get_record",
    "get_target",
    "init_target_engine",
    "list_targets",
    "register_target",
]

Builder = Callable[..., tuple[Any, Any]]  # (sch, **options) -> (model, optimizer)

# The kinds of dialect the seed API names; every target registers one builder, the engine.
DIALECT_KINDS = ("runtime_engine",)


@dataclass(frozen=True)
class TargetRecord:
    """Everything known of one build target.

    Attributes:
        name: ``slapo.build(sch, target=name)``.
        builder: ``builder(sch, **options) -> (model, optimizer)``.
        distributed: it needs ``torch.distributed`` running (``slapo.env.setup()``).
        precisions: the ``precision=`` values its builder trains in (a builder registered
            without saying gets fp32 only: ``slapo.build`` refuses others by name).
        device_option: its builder places the model with ``device=`` (DeepSpeed's engine
            places it on ``LOCAL_RANK``'s accelerator itself).
        host_state: the model state stays in host memory and is streamed to the devices
            (RoundPipe): batches stay on the host too.
        memory: how :func:`slapo.estimate_layout` models a rank of it (a
            ``slapo.memory.LAYOUT_TARGETS`` name; None: not modelled).

    Example:
        >>> get_record("fsdp").distributed, get_record(None).name
        (True, 'eager')
    """

    name: str
    builder: Builder
    distributed: bool = False
    precisions: tuple[str, ...] = ("fp32",)
    device_option: bool = False
    host_state: bool = False
    memory: str | None = None


_TARGETS: dict[str, TargetRecord] = {}
_ALIASES: dict[str | None, str] = {None: "eager", "": "eager"}


def register_target(name: str, **facts: Any) -> Callable[[Builder], Builder]:
    """Decorator registering the builder of target ``name`` (``slapo.build(sch, target=name)``)
    with the facts of its :class:`TargetRecord` (``distributed=``, ``precisions=``, ...).

    Example:
        >>> @register_target("my_target")
        ... def build_mine(sch, **options):
        ...     return sch.mod, None
        >>> del _TARGETS["my_target"]  # unregistered again: this was only an example
    """

    def decorator(builder: Builder) -> Builder:
        _TARGETS[name] = TargetRecord(name, builder, **facts)
        return builder

    return decorator


def get_record(target: str | None) -> TargetRecord:
    """The :class:`TargetRecord` of ``target`` (``None`` and ``""`` mean ``"eager"``).

    Example:
        >>> get_record("roundpipe").host_state
        True
    """
    record = _TARGETS.get(_name(target))
    if record is not None:
        return record
    hint = " (the deepspeed target needs `pip install deepspeed`)" if target == "deepspeed" else ""
    raise TargetError(
        f'no build target "{target}"; available targets: '
        f"{', '.join(list_targets()) or '(none)'}{hint}"
    )


def list_targets() -> list[str]:
    """The registered target names.

    Example:
        >>> "eager" in list_targets()
        True
    """
    return sorted(_TARGETS)


def _name(target: str | None) -> str:
    return _ALIASES.get(target, target)  # type: ignore[return-value]


def get_target(target: str | None) -> Builder:
    """The builder of ``target`` (``None`` and ``""`` mean ``"eager"``).

    Example:
        >>> get_target(None) is get_target("eager")
        True
    """
    return get_record(target).builder


def get_dialect_cls(cls_type: str, target: str | None, allow_none: bool = False) -> Any:
    """Get the framework dialect of ``target``: its engine builder for ``"runtime_engine"``.

    ``allow_none=True`` returns None for an unknown target; an unknown ``cls_type`` is always
    an error.

    Example:
        >>> get_dialect_cls("runtime_engine", "eager") is get_target("eager")
        True
    """
    if cls_type not in DIALECT_KINDS:
        raise TargetError(
            f'unknown dialect cls_type "{cls_type}": targets register one kind, '
            f"{', '.join(repr(k) for k in DIALECT_KINDS)} (the builder slapo.build calls)"
        )
    if allow_none and _name(target) not in _TARGETS:
        return None
    return get_target(target)


def init_target_engine(sch: Schedule, target: str | None, **kwargs: Any) -> tuple[Any, Any]:
    """Initialize the runtime engine of ``target`` for the schedule; returns (model, optimizer).

    Example:
        >>> from torch import nn
        >>> import slapo
        >>> model, opt = init_target_engine(slapo.create_schedule(nn.Linear(2, 2)), None)
    """
    record = get_record(target)
    precision = kwargs.get("precision")
    name = getattr(precision, "name", precision)
    if name is not None and name not in record.precisions:
        raise TargetError(
            f'target "{record.name}" trains in {", ".join(record.precisions)}, not {name}: '
            "register it with precisions=(...) once its builder takes precision="
        )
    return record.builder(sch, **kwargs)
