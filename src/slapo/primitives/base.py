"""The primitive registry: each primitive is a small class with one ``apply`` method."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ..exceptions import SlapoError

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = ["Primitive", "register_primitive", "list_primitives", "get_primitive"]

PRIMITIVES: dict[str, type[Primitive]] = {}
_ALIASES: dict[str, str] = {}


class Primitive:
    """Base class of schedule primitives.

    A subclass sets ``name`` (the method name on a schedule) and implements ``apply``; its
    docstring is the primitive's help text. ``aliases`` keeps older spellings working.

    Example:
        >>> @register_primitive()
        ... class Hello(Primitive):
        ...     '''Print the path of the module.'''
        ...     name = "hello_doc"
        ...     @staticmethod
        ...     def apply(sch):
        ...         print("hello", sch.path or "<root>")
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()

    @staticmethod
    def apply(sch: Schedule, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def is_verifiable(cls) -> bool:
        """Whether ``Verify`` can check this primitive by comparing outputs and gradients."""
        return True


def register_primitive(override: bool = False):
    """Class decorator that registers a :class:`Primitive` subclass under its ``name``.

    Args:
        override: replace an existing primitive of the same name instead of raising.
    """

    def decorator(cls: type[Primitive]) -> type[Primitive]:
        if not (isinstance(cls, type) and issubclass(cls, Primitive)) or not cls.name:
            raise SlapoError(
                f"register_primitive expects a Primitive subclass with a `name`, got {cls!r}"
            )
        for key in (cls.name, *cls.aliases):
            taken = PRIMITIVES.get(key) or PRIMITIVES.get(_ALIASES.get(key, ""))
            if taken is not None and taken is not cls and not override:
                raise SlapoError(
                    f"a primitive named '{key}' is already registered ({taken.__name__}); "
                    "pick another name or pass register_primitive(override=True)"
                )
        PRIMITIVES[cls.name] = cls
        for alias in cls.aliases:
            _ALIASES[alias] = cls.name
        return cls

    if isinstance(override, type):  # used bare: @register_primitive
        cls, override = override, False
        return decorator(cls)
    return decorator


def get_primitive(name: str) -> type[Primitive] | None:
    return PRIMITIVES.get(name) or PRIMITIVES.get(_ALIASES.get(name, ""))


def list_primitives(name_only: bool = True) -> list[str] | dict[str, type[Primitive]]:
    """List all available schedule primitives.

    Args:
        name_only: return the sorted names; otherwise a dict from name to primitive class, whose
            docstring (``help(cls)``) describes it.

    Example:
        >>> "checkpoint" in list_primitives()
        True
    """
    if name_only:
        return sorted(PRIMITIVES)
    return dict(sorted(PRIMITIVES.items()))
