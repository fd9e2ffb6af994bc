"""Tuning spaces: named symbols with candidate values, possibly depending on each other.

A space is described by a function ``update_space(args, space)`` that calls
``space.create_symbol(name, vals)`` for every knob. Later symbols may read the values of
earlier ones (``sym.value``) to choose their candidates. Enumeration follows a simple
protocol: the function is called once per pass; each pass fixes the next symbol to one of
its candidates, and every symbol after it is re-created, because its candidates may depend
on the symbols fixed so far.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .errors import SymbolIndexError, TuneTypeError, TuneValueError

logger = logging.getLogger("slapo.tune")

#: A value a symbol may take: it becomes a command-line flag and part of a JSON key.
Value = int | float | str | bool | None
UpdateSpaceFn = Callable[[Any, "Space"], "Space | None"]

_SCALARS = (int, float, str, bool, type(None))


def config_key(cfg: Mapping[str, Value]) -> str:
    """Return the canonical string of a configuration, used as its database key.

    Example:
        >>> config_key({"b": 2, "a": True})
        '{"a": true, "b": 2}'
    """
    return json.dumps(dict(cfg), sort_keys=True)


class Symbol:
    """A tunable knob: a name and its candidate values; fixed to one of them during a pass.

    Example:
        >>> sym = Symbol("batch_size", [8, 16, 32])
        >>> sym.value                   # not fixed yet: the first candidate, provisionally
        8
        >>> sym.fix_at(2)
        >>> (sym.is_fixed(), sym.value)
        (True, 32)
    """

    def __init__(self, name: str, vals: Sequence[Value]) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise TuneTypeError(
                f"Symbol name must be a Python identifier string, got name={name!r}"
            )
        if isinstance(vals, (str, bytes)) or not isinstance(vals, (Sequence, range)):
            raise TuneTypeError(
                f"Symbol {name!r}: vals must be a list, tuple or range of candidates, "
                f"got vals={vals!r}"
            )
        vals = list(vals)
        for v in vals:
            if not isinstance(v, _SCALARS):
                raise TuneTypeError(
                    f"Symbol {name!r}: every candidate in vals must be an int, float, str, bool "
                    f"or None (it becomes a command-line flag), got {v!r} ({type(v).__name__})"
                )
        if len({json.dumps(v) for v in vals}) != len(vals):
            raise TuneValueError(f"Symbol {name!r}: vals has duplicate candidates: {vals!r}")
        self.name = name
        self.vals: list[Value] = vals
        self.fixed_idx: int | None = None

    def fix_at(self, idx: int) -> None:
        """Fix the symbol to its ``idx``-th candidate."""
        if not 0 <= idx < len(self.vals):
            raise SymbolIndexError(
                f"Symbol {self.name!r}: idx={idx} out of range for {self.vals!r}"
            )
        self.fixed_idx = idx

    def is_fixed(self) -> bool:
        """Whether the symbol has been fixed to one candidate."""
        return self.fixed_idx is not None

    @property
    def value(self) -> Value:
        """The fixed value; before fixing, the first candidate stands in (``None`` if empty).

        A provisional value lets ``update_space`` compute dependent candidates without
        special cases: every symbol after an unfixed one is re-created once it is fixed.
        """
        if self.fixed_idx is not None:
            return self.vals[self.fixed_idx]
        return self.vals[0] if self.vals else None

    def __repr__(self) -> str:
        state = f"={self.value!r}" if self.is_fixed() else ""
        return f"Symbol({self.name!r}, {self.vals!r}){state}"


class Space:
    """An ordered set of symbols; iterating it yields every valid configuration as a dict.

    Without ``update_space`` the space is the product of the symbols created on it. With it,
    symbols may depend on earlier ones; a symbol whose candidate list is empty prunes that
    branch (no valid configuration there).

    Example:
        >>> def update_space(args, space):
        ...     tp = space.create_symbol("tp", [1, 2])
        ...     space.create_symbol("batch_size", [b for b in (4, 8) if b * tp.value <= 8])
        ...     return space
        >>> list(Space(update_space))
        [{'tp': 1, 'batch_size': 4}, {'tp': 1, 'batch_size': 8}, {'tp': 2, 'batch_size': 4}]
    """

    def __init__(self, update_space: UpdateSpaceFn | None = None, args: Any = None) -> None:
        if update_space is not None and not callable(update_space):
            raise TuneTypeError(f"update_space must be callable, got update_space={update_space!r}")
        self.space: dict[str, Symbol] = {}
        self.update_space = update_space
        self.args = args
        self._touched: dict[str, None] | None = None  # names created this pass, in order

    # ----- building -----------------------------------------------------------------------
    def create_symbol(self, name: str, vals: Sequence[Value]) -> Symbol:
        """Create a symbol; if it exists and is fixed, keep it, otherwise re-create it.

        Example:
            >>> space = Space()
            >>> space.create_symbol("ckpt", [True, False])
            Symbol('ckpt', [True, False])
        """
        if self._touched is not None:
            self._touched[name] = None
        old = self.space.get(name)
        if old is not None and old.is_fixed():
            return old
        sym = Symbol(name, vals)
        self.space[name] = sym
        return sym

    def clone(self) -> Space:
        """Return an independent copy (symbols and their fixed state included)."""
        new = Space(self.update_space, self.args)
        new.space = {name: copy.deepcopy(sym) for name, sym in self.space.items()}
        return new

    def __getitem__(self, name: str) -> Symbol:
        return self.space[name]

    def __contains__(self, name: object) -> bool:
        return name in self.space

    def to_dict(self) -> dict[str, Value]:
        """Return ``{name: value}`` of every symbol (provisional values for unfixed ones)."""
        return {name: sym.value for name, sym in self.space.items()}

    @staticmethod
    def cfg_dict_to_str(cfg_dict: Mapping[str, Value]) -> str:
        """Format a configuration for logs.

        Example:
            >>> Space.cfg_dict_to_str({"batch_size": 8, "ckpt": True})
            'batch_size=8, ckpt=True'
        """
        return ", ".join(f"{k}={v}" for k, v in cfg_dict.items())

    # ----- enumeration --------------------------------------------------------------------
    def _run_pass(self) -> Space:
        """Call ``update_space`` once on a copy; drop symbols it no longer creates."""
        nxt = self.clone()
        if self.update_space is None:
            return nxt  # a static space: its symbols never change
        nxt._touched = {}
        ret = self.update_space(self.args, nxt)
        if ret is not None and ret is not nxt:
            raise TuneTypeError(
                f"update_space must return the Space it was given or None, got {ret!r}"
            )
        touched = nxt._touched
        # Keep this pass's creation order; a symbol created on an earlier pass but not on
        # this one belongs to another branch and is dropped.
        nxt.space = {n: nxt.space[n] for n in touched}
        nxt._touched = None
        return nxt

    def _walk(self) -> Iterator[dict[str, Value]]:
        space = self._run_pass()
        nxt = next((s for s in space.space.values() if not s.is_fixed()), None)
        if nxt is None:
            yield space.to_dict()
            return
        for idx in range(len(nxt.vals)):  # an empty candidate list prunes this branch
            child = space.clone()
            child.space[nxt.name].fix_at(idx)
            yield from child._walk()

    def __iter__(self) -> Iterator[dict[str, Value]]:
        """Yield every valid configuration once, in enumeration order."""
        start = self.clone()
        for sym in start.space.values():
            sym.fixed_idx = None
        seen: set[str] = set()
        for cfg in start._walk():
            key = config_key(cfg)
            if key not in seen:
                seen.add(key)
                yield cfg

    def log_space(
        self, training_script_args: Any, update_space_fn: UpdateSpaceFn
    ) -> list[dict[str, Value]]:
        """Log every configuration of the space ``update_space_fn`` describes; return them.

        Example:
            >>> def update_space(args, space):
            ...     space.create_symbol("ckpt", [True, False])
            >>> Space().log_space({}, update_space)
            [{'ckpt': True}, {'ckpt': False}]
        """
        cfgs = list(Space(update_space_fn, training_script_args))
        logger.info("Tuning space: %d configurations", len(cfgs))
        for i, cfg in enumerate(cfgs):
            logger.info("  [%d] %s", i, self.cfg_dict_to_str(cfg))
        return cfgs

    def __repr__(self) -> str:
        return f"Space({list(self.space.values())!r})"
