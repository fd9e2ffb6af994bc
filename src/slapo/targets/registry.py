"""The registry of build targets, keyed by target name.

A target is a builder ``fn(sch, **options) -> (model, optimizer)`` that honours the training-loop
contract of :mod:`slapo.targets.contract`. ``get_dialect_cls(cls_type, target)`` and
``init_target_engine`` are the seed API: the one kind of dialect is ``"runtime_engine"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..exceptions import TargetError

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = [
    "DIALECT_KINDS",
    "Builder",
    "get_dialect_cls",
    "get_target",
    "init_target_engine",
    "list_targets",
    "register_target",
]

Builder = Callable[..., tuple[Any, Any]]  # (sch, **options) -> (model, optimizer)

# The kinds of dialect the seed API names; every target registers one builder, the engine.
DIALECT_KINDS = ("runtime_engine",)

_TARGETS: dict[str, Builder] = {}
_ALIASES: dict[str | None, str] = {None: "eager", "": "eager"}


def register_target(name: str) -> Callable[[Builder], Builder]:
    """Decorator registering the builder of target ``name`` (``slapo.build(sch, target=name)``).

    Example:
        >>> @register_target("my_target")
        ... def build_mine(sch, **options):
        ...     return sch.mod, None
    """

    def decorator(builder: Builder) -> Builder:
        _TARGETS[name] = builder
        return builder

    return decorator


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
    builder = _TARGETS.get(_name(target))
    if builder is not None:
        return builder
    hint = " (the deepspeed target needs `pip install deepspeed`)" if target == "deepspeed" else ""
    raise TargetError(
        f'no build target "{target}"; available targets: '
        f"{', '.join(list_targets()) or '(none)'}{hint}"
    )


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
        >>> model, opt = init_target_engine(slapo.create_schedule(nn.Linear(2, 2)), None)
    """
    return get_target(target)(sch, **kwargs)
