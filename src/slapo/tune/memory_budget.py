"""``slapo tune --memory-budget``: drop the configurations that cannot fit, before any trial.

Every configuration still to measure is estimated first (:func:`slapo.estimate_memory`: a fake
training step, nothing allocated). One whose estimate needs more than the budget is recorded in the
database with status ``"skipped"`` and the reason, and never runs; a later run with a larger budget
estimates it again. The figure compared is :attr:`~slapo.memory.MemoryEstimate.required`.

Where the estimate comes from:

* the ``--config`` file's ``estimate_memory(args, cfg)``, when it defines one: it returns bytes, a
  :class:`~slapo.memory.MemoryEstimate`, or None (unknown: the configuration runs);
* otherwise, for a ``slapo train`` command, what ``slapo train`` would build with the command's
  flags and the configuration's (:func:`slapo.train.run_memory.train_estimator`, registered with
  :func:`register_command_estimator`; ``--tp N`` is one rank of N). A layout (``tp``, ``pp``,
  ``dp`` symbols, see :mod:`slapo.tune.launch`) is estimated per rank, for the rank that needs the
  most: a dp2 x pp2 layout that fits the budget fits it on each of its 4 processes.

Example:
    slapo tune --config examples/tune_schedule.py --db db.json --memory-budget 40MiB \\
        -- slapo train --model gpt2 --steps 20 --no-progress --json
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import TuneTypeError
from .space import Value

__all__ = [
    "SKIPPED",
    "Estimator",
    "command_estimator",
    "register_command_estimator",
    "required_bytes",
    "train_argv",
]

#: The status of a configuration dropped by the memory budget (it never ran).
SKIPPED = "skipped"

#: ``estimate(cfg)`` -> bytes, a MemoryEstimate, or None when unknown.
Estimator = Callable[[Mapping[str, Value]], Any]

_COMMAND_ESTIMATORS: list[Callable[[Sequence[str]], Estimator | None]] = []


def required_bytes(estimate: Any) -> int | None:
    """The bytes an estimate needs: an int as is, a MemoryEstimate's ``required``, None as is.

    Example:
        >>> required_bytes(1024), required_bytes(None)
        (1024, None)
    """
    if estimate is None:
        return None
    if isinstance(estimate, int) and not isinstance(estimate, bool) and estimate >= 0:
        return estimate
    required = getattr(estimate, "required", None)
    if isinstance(required, int) and not isinstance(required, bool):
        return required
    raise TuneTypeError(
        "a memory estimate must be a number of bytes (int >= 0), a slapo MemoryEstimate or "
        f"None (unknown), got {estimate!r}"
    )


def train_argv(command: Sequence[str]) -> list[str] | None:
    """The flags after ``train`` when ``command`` runs ``slapo train``, else None.

    Recognizes ``slapo train ...`` (any path to the ``slapo`` script) and
    ``python -m slapo train ...``.

    Example:
        >>> train_argv(["slapo", "train", "--model", "gpt2"])
        ['--model', 'gpt2']
        >>> train_argv(["python", "-m", "slapo", "train", "--steps", "3"])
        ['--steps', '3']
        >>> train_argv(["python", "train.py"]) is None
        True
    """
    cmd = list(command)
    if len(cmd) >= 2 and os.path.basename(cmd[0]) == "slapo" and cmd[1] == "train":
        return cmd[2:]
    for i in range(len(cmd) - 2):
        if cmd[i] == "-m" and cmd[i + 1] in ("slapo", "slapo.cli") and cmd[i + 2] == "train":
            return cmd[i + 3 :]
    return None


def register_command_estimator(
    fn: Callable[[Sequence[str]], Estimator | None],
) -> Callable[[Sequence[str]], Estimator | None]:
    """Register ``fn(command)``: the estimator of the trials of ``command``, or None when it does
    not know the command. ``slapo.train`` registers one for ``slapo train`` commands (the tuner
    sits below the main job and does not import it).

    Example:
        >>> @register_command_estimator
        ... def fixed_size(command):
        ...     return (lambda cfg: 1024) if command[:1] == ["my-trainer"] else None
        >>> command_estimator(["my-trainer"])({})
        1024
        >>> _COMMAND_ESTIMATORS.remove(fixed_size)
    """
    _COMMAND_ESTIMATORS.append(fn)
    return fn


def command_estimator(command: Sequence[str]) -> Estimator | None:
    """The estimator a registered command estimator gives for ``command``, else None.

    Example:
        >>> command_estimator(["python", "my_own_script.py"]) is None
        True
    """
    for fn in _COMMAND_ESTIMATORS:
        estimate = fn(command)
        if estimate is not None:
            return estimate
    return None
