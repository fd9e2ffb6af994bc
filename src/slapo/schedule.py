"""The schedule tree: one :class:`Schedule` per submodule, mirroring the model's module tree.

A schedule never changes the user's model code. Primitives (``sch["a.b"].checkpoint()``) change how
a module runs; every primitive applied is recorded, in order and with its arguments, in the tree's
shared :class:`ScheduleMetadata` so that targets and ``Verify`` can read and replay it.

The primitive registry lives here too: a schedule dispatches ``sch.name(...)`` to the
:class:`Primitive` registered under ``name``. The built-in primitives (``slapo.primitives``)
register themselves on import, from the layer above, so that this module imports none of them.
"""

from __future__ import annotations

import difflib
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import fx, nn

from .exceptions import PrimitiveError, SchedulePathError, ScheduleTypeError, SlapoError
from .ranks import get_rank, get_world_size
from .surgery import forward_wraps, join_path, label

__all__ = [
    "PRIMITIVES",
    "Primitive",
    "PrimitiveRecord",
    "Schedule",
    "ScheduleMetadata",
    "create_schedule",
    "get_primitive",
    "is_module_list",
    "list_primitives",
    "register_primitive",
]


@dataclass
class PrimitiveRecord:
    """One applied primitive: where, which, and with what arguments."""

    path: str
    name: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        parts = [_short_repr(a) for a in self.args]
        parts += [f"{k}={_short_repr(v)}" for k, v in self.kwargs.items()]
        return f"{self.name}({', '.join(parts)})"


@dataclass
class ScheduleMetadata:
    """The metadata of a schedule tree, shared by the root and every child schedule.

    Attributes:
        tie_weights: parameters known to be tied, each mapped to the parameter it shares storage with.
        param_tags: the annotation keys set by ``annotate`` (they are carried across ``build``).
        primitives: every primitive applied anywhere in the tree, in application order. ``Verify``
            replays them; targets read them (e.g. pipeline cuts).
    """

    tie_weights: dict[nn.Parameter, nn.Parameter] = field(default_factory=OrderedDict)
    param_tags: set[str] = field(default_factory=set)
    primitives: list[PrimitiveRecord] = field(default_factory=list)
    # How many primitives are running right now: a primitive that calls another one records only
    # the outer call, so a replay does not apply the inner one twice.
    _depth: int = 0


# ----- the primitive registry ----------------------------------------------------------------
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
        ...         print("hello", label(sch.path))
        >>> del PRIMITIVES["hello_doc"]  # unregistered again: this was only an example
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
            taken = get_primitive(key)
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
    """The primitive registered under ``name`` (or under an alias of it), or None."""
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


def is_module_list(module: nn.Module, name: str = "", parent: Schedule | None = None) -> bool:
    """Whether ``module`` is, or was before tracing, a list of layers.

    A ``ModuleList`` becomes a plain ``nn.Module`` or ``fx.GraphModule`` after tracing; its children
    are still named ``"0"``, ``"1"``, ... and it owns no parameters of its own, so it is still treated
    as a list.

    Example:
        >>> is_module_list(nn.ModuleList([nn.Linear(2, 2)]))
        True
    """
    if isinstance(module, nn.ModuleList):
        return True
    names = [n for n, _ in module.named_children()]
    if not names or [str(i) for i in range(len(names))] != names:
        return False
    return next(module.parameters(recurse=False), None) is None


class Schedule:
    """The schedule of one module, and through ``child`` of its whole subtree.

    Create one with :func:`create_schedule`. Index it with a dotted path to reach a submodule's
    schedule, then call primitives on it; ``slapo.list_primitives()`` lists them.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> sch = create_schedule(model)
        >>> sch["0"].checkpoint()
        >>> sch["0"].path, type(sch["0"].mod).__name__
        ('0', 'Linear')
    """

    def __init__(
        self,
        mod: nn.Module,
        name: str = "",
        path: str = "",
        parent: Schedule | None = None,
        group: Any = None,
        metadata: ScheduleMetadata | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(mod, nn.Module):
            raise ScheduleTypeError(
                f"create_schedule needs an nn.Module, got {type(mod).__name__}; "
                "pass the model (or submodule) itself"
            )
        self.mod = mod
        self.name = name
        self.path = path
        self.parent = parent
        self.group = group
        self.metadata = metadata if metadata is not None else ScheduleMetadata()
        self.extra: dict[str, Any] = dict(kwargs)
        self.child: OrderedDict[str, Schedule] = OrderedDict()
        self._build_children()

    # ----- the tree -------------------------------------------------------------------------
    def _build_children(self) -> None:
        self.child = OrderedDict(
            (name, Schedule(sub, name, join_path(self.path, name), self, self.group, self.metadata))
            for name, sub in self.mod.named_children()
        )

    @property
    def is_module_list(self) -> bool:
        return is_module_list(self.mod, self.name, self.parent)

    @property
    def rank(self) -> int:
        """This process's rank in the schedule's group (``create_schedule(..., group=)``, the
        world if None); 0 without torch.distributed.

        Example:
            >>> create_schedule(nn.Linear(2, 2)).rank  # no process group started
            0
        """
        return get_rank(self.group)

    @property
    def world_size(self) -> int:
        """The size of the schedule's group (the world if None); 1 without torch.distributed.

        Example:
            >>> create_schedule(nn.Linear(2, 2)).world_size  # no process group started
            1
        """
        return get_world_size(self.group)

    @property
    def root(self) -> Schedule:
        sch = self
        while sch.parent is not None:
            sch = sch.parent
        return sch

    def get_module(self, target: str | fx.Node | tuple[str, fx.Node]) -> nn.Module:
        """The submodule that ``target`` names, relative to this schedule's module: a dotted path
        (a ``call_module`` node's target), a ``call_module`` node, or a ``(path, node)`` pair of
        a ``find`` match (the node's target is then relative to the graph at ``path``).

        Example:
            >>> sch = create_schedule(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
            >>> type(sch.get_module("1")).__name__
            'ReLU'
        """
        if isinstance(target, tuple) and len(target) == 2 and isinstance(target[1], fx.Node):
            target = join_path(target[0], str(target[1].target))
        elif isinstance(target, fx.Node):
            if target.op not in ("call_module", "get_attr"):
                raise PrimitiveError(
                    f'get_module on "{label(self.path)}": node {target.name} is a '
                    f"{target.op} node; only call_module nodes name a submodule"
                )
            target = str(target.target)
        if not isinstance(target, str):
            raise ScheduleTypeError(f"get_module takes a dotted path or an fx node, got {target!r}")
        try:
            return self.mod.get_submodule(target)
        except AttributeError as exc:
            raise SchedulePathError(
                f'get_module on "{label(self.path)}": no submodule "{target}" ({exc})'
            ) from exc

    def named_schedules(self, prefix: str = "") -> Iterator[tuple[str, Schedule]]:
        """Yield ``(relative path, schedule)`` for this schedule and every descendant, pre-order."""
        yield prefix, self
        for name, sch in self.child.items():
            yield from sch.named_schedules(join_path(prefix, name))

    @property
    def applied_primitives(self) -> list[PrimitiveRecord]:
        """The primitives applied to this very schedule (not its children), in order."""
        return [r for r in self.metadata.primitives if r.path == self.path]

    def __getitem__(self, path: str | int) -> Schedule:
        if isinstance(path, int):
            path = str(path)
        if not isinstance(path, str):
            raise ScheduleTypeError(
                f"a schedule path is a dotted string such as 'layers.0', got {path!r}"
            )
        if path == "":
            return self
        sch = self
        for i, part in enumerate(path.split(".")):
            if part not in sch.child:
                raise SchedulePathError(self._path_error(path, ".".join(path.split(".")[:i]), part))
            sch = sch.child[part]
        return sch

    def __contains__(self, path: object) -> bool:
        try:
            self[path]  # type: ignore[index]
        except (SchedulePathError, TypeError):
            return False
        return True

    def _path_error(self, path: str, found: str, missing: str) -> str:
        where = f'schedule "{self.path}"' if self.path else "the root schedule"
        owner = f'"{found}"' if found else "the top module"
        candidates = [p for p, _ in self.named_schedules() if p]
        close = difflib.get_close_matches(path, candidates, n=3, cutoff=0.5)
        children = list(self[found].child) if found in self or found == "" else []
        hint = f" Closest existing paths: {', '.join(close)}." if close else ""
        kids = f" Children of {owner}: {', '.join(children[:12]) or '(none)'}."
        return f'no submodule "{path}" under {where}: "{missing}" is not a child of {owner}.{kids}{hint}'

    # ----- primitives -----------------------------------------------------------------------
    def __getattr__(self, name: str) -> Callable[..., Any]:
        # Only reached when normal lookup fails: primitives are looked up in the registry so that
        # user primitives registered after import become methods too.
        if name.startswith("_"):
            raise AttributeError(name)
        prim = get_primitive(name)
        if prim is None:
            raise AttributeError(
                f"'Schedule' has no attribute or primitive '{name}'; "
                "slapo.list_primitives() lists the primitives"
            )

        @functools.wraps(prim.apply)
        def call(*args: Any, **kwargs: Any) -> Any:
            return self._apply_primitive(prim, args, kwargs)

        return call

    def _apply_primitive(self, prim: type[Primitive], args: tuple, kwargs: dict[str, Any]) -> Any:
        meta = self.metadata
        meta._depth += 1
        try:
            result = prim.apply(self, *args, **kwargs)
        finally:
            meta._depth -= 1
        if meta._depth == 0:
            meta.primitives.append(PrimitiveRecord(self.path, prim.name, tuple(args), dict(kwargs)))
        return result

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(list_primitives(name_only=True)))

    # ----- module surgery, used by primitives ---------------------------------------------------
    def swap_module(self, new_mod: nn.Module) -> None:
        """Put ``new_mod`` where this schedule's module is and rebuild the child schedules."""
        if self.parent is not None:
            setattr(self.parent.mod, self.name, new_mod)
        self.mod = new_mod
        self._build_children()

    def require_unapplied(self, primitive: str) -> None:
        """Raise if ``primitive`` was already applied to this schedule's current module."""
        if primitive in forward_wraps(self.mod):
            raise PrimitiveError(
                f'"{label(self.path)}" already has {primitive}() applied; applying it twice '
                "would wrap the module twice. Apply it once."
            )

    # ----- printing -----------------------------------------------------------------------------
    def __repr__(self) -> str:
        lines = [f"Schedule({type(self.mod).__name__}){self._prims_suffix()}"]
        self._tree_lines(lines, "")
        return "\n".join(lines)

    def _prims_suffix(self) -> str:
        prims = self.applied_primitives
        return f"  [{'; '.join(str(p) for p in prims)}]" if prims else ""

    def _tree_lines(self, lines: list[str], indent: str) -> None:
        items = list(self.child.items())
        for i, (name, sch) in enumerate(items):
            last = i == len(items) - 1
            lines.append(
                f"{indent}{'└─ ' if last else '├─ '}{name} ({type(sch.mod).__name__})"
                f"{sch._prims_suffix()}"
            )
            sch._tree_lines(lines, indent + ("   " if last else "│  "))


def create_schedule(
    root: nn.Module,
    name: str = "",
    path: str = "",
    parent: Schedule | None = None,
    group: Any = None,
    **kwargs: Any,
) -> Schedule:
    """Create a schedule for ``root`` that preserves the module hierarchy.

    Args:
        root: the module to schedule, e.g. a ``transformers`` model.
        name: the module's name in its parent ("" for the top module).
        path: the dotted path from the top module ("" for the top module).
        parent: the parent schedule, None for the top module.
        group: the process group (or DeviceMesh dimension) that tensor-parallel primitives use;
            None means the default (world) group. ``sch.rank`` and ``sch.world_size`` are this
            process's rank in it and its size.
        **kwargs: extra attributes kept on the schedule (``sch.extra``); ``metadata=`` shares an
            existing :class:`ScheduleMetadata`.

    Example:
        >>> sch = create_schedule(nn.Sequential(nn.Linear(2, 2)))
        >>> print(sch)
        Schedule(Sequential)
        └─ 0 (Linear)
    """
    metadata = kwargs.pop("metadata", None)
    if parent is not None and metadata is None:
        metadata = parent.metadata
    return Schedule(root, name, path, parent, group, metadata, **kwargs)


def _short_repr(value: Any) -> str:
    if isinstance(value, nn.Module):
        return f"<{type(value).__name__}>"
    if isinstance(value, torch.Tensor):
        return f"<Tensor {tuple(value.shape)}>"
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
