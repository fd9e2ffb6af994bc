"""Auto-tuning: describe a space of knobs, measure configurations, keep the results.

Example:
    >>> from slapo.tune import Space
    >>> def update_space(args, space):
    ...     space.create_symbol("batch_size", [8, 16])
    ...     space.create_symbol("ckpt", [True, False])
    >>> len(list(Space(update_space)))
    4
"""

from .database import Database, DatabaseCorruptError
from .launch import launch_argv, layout_processes
from .space import Space, Symbol, config_key
from .strategies import STRATEGIES, Exhaustive, ModelGuided, RandomSearch, Strategy, make_strategy
from .trial import TrialResult, config_to_flags, run_trial
from .tuner import TuneError, TuneInterrupted, Tuner

__all__ = [
    "STRATEGIES",
    "Database",
    "DatabaseCorruptError",
    "Exhaustive",
    "ModelGuided",
    "RandomSearch",
    "Space",
    "Strategy",
    "Symbol",
    "TrialResult",
    "TuneError",
    "TuneInterrupted",
    "Tuner",
    "config_key",
    "config_to_flags",
    "launch_argv",
    "layout_processes",
    "make_strategy",
    "run_trial",
]
