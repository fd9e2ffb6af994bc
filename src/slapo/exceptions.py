"""Typed errors: every failure a user can cause names the schedule path and how to fix it."""

from __future__ import annotations

__all__ = [
    "SlapoError",
    "SchedulePathError",
    "PrimitiveError",
    "PrimitiveTypeError",
    "TargetError",
    "InputError",
    "ConfigError",
    "ScheduleTypeError",
    "OpError",
    "DataError",
    "CorpusError",
]


class SlapoError(Exception):
    """Base class of every error Slapo raises on bad input."""


class SchedulePathError(SlapoError, KeyError):
    """A schedule path (``sch["a.b.c"]``) that names no submodule.

    It is also a ``KeyError``, so ``except KeyError`` keeps working for code that treats a schedule
    like a mapping.
    """

    def __str__(self) -> str:  # KeyError would quote the message; show it as written
        return str(self.args[0]) if self.args else ""


class PrimitiveError(SlapoError, ValueError):
    """A primitive applied with wrong arguments, or where it cannot apply (e.g. twice)."""


class PrimitiveTypeError(SlapoError, TypeError):
    """A primitive given an argument of the wrong type (e.g. ``replace`` with a non-module)."""


class ScheduleTypeError(SlapoError, TypeError):
    """A schedule created from, or indexed by, a value of the wrong type (``create_schedule`` of a
    non-module, ``sch[0]`` instead of ``sch["layers.0"]``)."""


class TargetError(SlapoError, ValueError):
    """An unknown build target or a bad option for one."""


class InputError(SlapoError):
    """Bad input on the command line (a flag out of range, a data file or model directory that
    cannot be used): ``slapo train`` prints the message as one line and exits with status 2, as
    argparse does for a usage error."""


class ConfigError(SlapoError, ValueError):
    """A training configuration that cannot run as given (a knob out of range, a trial's
    ``slapo train`` flags that do not parse). Unlike :class:`InputError` it is raised to the
    caller, not turned into a command-line exit."""


class OpError(SlapoError, ValueError):
    """A kernel module or function of :mod:`slapo.op` given sizes or options it cannot serve."""


class DataError(SlapoError, ValueError):
    """A dataset (:mod:`slapo.data`) given a corpus or sizes it cannot serve batches from."""


class CorpusError(SlapoError, RuntimeError):
    """The built-in training corpus (the Python standard library's source) cannot be read here."""
