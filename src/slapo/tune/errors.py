"""The errors of ``slapo.tune``: one family under :class:`TuneError`, each keeping the standard
base its callers catch (``ValueError`` for a bad value, ``TypeError`` for a wrong kind).

Example:
    >>> from slapo.tune import Space
    >>> try:
    ...     Space().create_symbol("batch_size", [8, 8])
    ... except TuneValueError as exc:
    ...     print(isinstance(exc, ValueError), isinstance(exc, TuneError))
    True True
"""

from __future__ import annotations

from ..exceptions import SlapoError

__all__ = [
    "TuneError",
    "TuneValueError",
    "TuneTypeError",
    "SymbolIndexError",
    "DatabaseCorruptError",
]


class TuneError(SlapoError, RuntimeError):
    """A tuning run cannot start or go on (empty space, bad options, ...)."""


class TuneValueError(TuneError, ValueError):
    """A tuning option, symbol, strategy or launch layout with a value it cannot take."""


class TuneTypeError(TuneError, TypeError):
    """A tuning option or callback of the wrong kind (e.g. ``update_space`` returning no Space)."""


class SymbolIndexError(TuneError, IndexError):
    """A symbol fixed at an index outside its values."""


class DatabaseCorruptError(TuneError, ValueError):
    """The database file exists but is not a valid Slapo tuning database."""
