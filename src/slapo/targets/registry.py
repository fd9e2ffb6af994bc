"""The registry of framework dialects."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..exceptions import TargetError

if TYPE_CHECKING:
    from ..schedule import Schedule

_DIALECTS: dict[tuple[str, str], Any] = {}
_ALIASES = {None: "eager", "": "eager"}


def register_dialect(cls_type: str, target: str):
    """Decorator registering a dialect class (or function) for ``(cls_type, target)``.

    Example:
        >>> @register_dialect("runtime_engine", "my_target")
        ... def my_engine(sch, **kwargs):
        ...     return sch.mod, None
    """

    def decorator(obj: Any) -> Any:
        _DIALECTS[(cls_type, target)] = obj
        return obj

    return decorator


def _normalize(target: str | None) -> str:
    return _ALIASES.get(target, target)  # type: ignore[arg-type]


def list_targets(cls_type: str = "runtime_engine") -> list[str]:
    """The targets that provide ``cls_type``."""
    return sorted(t for (c, t) in _DIALECTS if c == cls_type)


def get_dialect_cls(cls_type: str, target: str | None, allow_none: bool = False) -> Any:
    """Get the framework dialect registered for ``(cls_type, target)``."""
    key = (cls_type, _normalize(target))
    if key in _DIALECTS:
        return _DIALECTS[key]
    if allow_none:
        return None
    raise TargetError(
        f'no "{cls_type}" for target "{target}"; available targets: '
        f"{', '.join(list_targets(cls_type)) or '(none)'}"
        + (" (the deepspeed target needs `pip install deepspeed`)" if target == "deepspeed" else "")
    )


def init_target_engine(sch: Schedule, target: str | None, **kwargs: Any) -> tuple[Any, Any]:
    """Initialize the runtime engine of ``target`` for the schedule; returns (model, optimizer)."""
    engine = get_dialect_cls("runtime_engine", target)
    return engine(sch, **kwargs)
