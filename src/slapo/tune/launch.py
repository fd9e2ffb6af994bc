"""A trial's command line: the configuration's flags, and the launcher a layout needs.

Layouts are tuning symbols: a trial of ``tp``/``pp``/``cp``/``dp`` runs on ``dp * pp * cp * tp``
processes. A configuration that holds any of :data:`LAYOUT_SYMBOLS` is launched under torchrun, one
process per rank of its layout; ``tp``, ``pp`` and ``cp`` stay flags of the trial (``--tp 2 --pp
2``), ``dp`` does not: the data-parallel replicas are the processes left over (``slapo train`` runs
dp = processes / (tp * pp * cp)). ``ep`` is a flag too (``--ep``) and takes no processes of its
own: expert parallelism borrows its ranks from dp x cp (:func:`expert_sizes` lists the sizes that
fit a layout). A ``slapo train`` command becomes ``python -m torch.distributed.run
--nproc-per-node N --master-port PORT -m slapo train ...``; any other command runs under torchrun's
``--no-python`` (it reads its rank from ``RANK``/``WORLD_SIZE``, as torchrun sets them).

Example:
    >>> cfg = {"tp": 2, "pp": 1, "dp": 2}
    >>> layout_processes(cfg)
    4
    >>> launch_argv(["slapo", "train", "--steps", "3"], cfg, port=29500)[1:]  # doctest: +NORMALIZE_WHITESPACE
    ['-m', 'torch.distributed.run', '--nproc-per-node', '4', '--master-port', '29500',
     '-m', 'slapo', 'train', '--steps', '3', '--tp', '2', '--pp', '1']
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence

from .errors import TuneValueError
from .space import Value

__all__ = [
    "LAUNCHER_SYMBOLS",
    "LAYOUT_SYMBOLS",
    "check_launchable",
    "config_to_flags",
    "expert_sizes",
    "free_port",
    "launch_argv",
    "layout_processes",
    "trial_flags",
]

#: Symbols that lay a trial out over processes: their product is the number of processes.
LAYOUT_SYMBOLS = ("dp", "pp", "cp", "tp")
#: Layout symbols the launcher carries (as the process count), never passed as flags.
LAUNCHER_SYMBOLS = ("dp",)

# Command-line spellings of tp and pp in a `slapo train` command (--num-stages: pp's old name).
_FLAG_NAMES = {"tp": ("--tp",), "pp": ("--pp", "--num-stages"), "cp": ("--cp",)}
_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def config_to_flags(cfg: Mapping[str, Value]) -> list[str]:
    """Turn a configuration into ``--name value`` flags (underscores become dashes).

    Example:
        >>> config_to_flags({"batch_size": 8, "ckpt_ratio": 0.5})
        ['--batch-size', '8', '--ckpt-ratio', '0.5']
    """
    flags: list[str] = []
    for name, val in cfg.items():
        flags += [f"--{name.replace('_', '-')}", str(val)]
    return flags


def _size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TuneValueError(f"layout symbol {name!r} must be a positive int, got {value!r}")
    return value


def _flag_value(command: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the last ``--name value`` / ``--name=value`` of ``command``, else None."""
    found = None
    for i, tok in enumerate(command):
        for name in names:
            if tok == name and i + 1 < len(command):
                found = command[i + 1]
            elif tok.startswith(name + "="):
                found = tok[len(name) + 1 :]
    return found


def expert_sizes(dp: int, cp: int = 1, num_experts: int | None = None) -> list[int]:
    """The expert-parallel sizes a layout of ``dp`` replicas and ``cp`` can run: ep borrows its
    ranks from dp x cp, so it divides ``dp * cp`` and is a multiple of ``cp`` (1 always fits),
    and it divides ``num_experts`` (when given).

    Example:
        >>> expert_sizes(dp=4), expert_sizes(dp=2, cp=2), expert_sizes(dp=4, num_experts=6)
        ([1, 2, 4], [1, 2, 4], [1, 2])
    """
    ranks = _size("dp", dp) * _size("cp", cp)
    return [1] + [
        e for e in range(2, ranks + 1)
        if ranks % e == 0 and e % cp == 0 and (num_experts is None or num_experts % e == 0)
    ]  # fmt: skip


def layout_processes(cfg: Mapping[str, Value], command: Sequence[str] = ()) -> int | None:
    """The processes a trial of ``cfg`` runs on: ``dp * pp * cp * tp``, or None when ``cfg``
    holds no layout symbol (the trial then runs the command as it is). A ``tp``/``pp``/``cp`` the
    configuration lacks is read from the command's flags (``slapo train --pp 2`` with a ``tp``
    symbol); ``ep`` takes no processes of its own.

    Example:
        >>> layout_processes({"tp": 2}, ["slapo", "train", "--num-stages", "2"])
        4
        >>> layout_processes({"dp": 2, "cp": 2, "ep": 4})
        4
        >>> layout_processes({"batch_size": 8}) is None
        True
    """
    if not any(name in cfg for name in LAYOUT_SYMBOLS):
        return None
    procs = 1
    for name in LAYOUT_SYMBOLS:
        if name in cfg:
            procs *= _size(name, cfg[name])
        elif name in _FLAG_NAMES:
            text = _flag_value(command, _FLAG_NAMES[name])
            if text is not None:
                procs *= _size(name, int(text))
    return procs


def trial_flags(cfg: Mapping[str, Value]) -> list[str]:
    """The flags a trial of ``cfg`` is given: every symbol but the launcher's (``dp``).

    Example:
        >>> trial_flags({"dp": 2, "tp": 2, "num_microbatches": 4})
        ['--tp', '2', '--num-microbatches', '4']
    """
    return config_to_flags({k: v for k, v in cfg.items() if k not in LAUNCHER_SYMBOLS})


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the rendezvous of one trial.

    Example:
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _slapo_train_split(command: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """``(python, flags)`` of a ``slapo train`` command (the interpreter that runs it and the
    flags after ``train``), else None."""
    cmd = list(command)
    if len(cmd) >= 2 and os.path.basename(cmd[0]) == "slapo" and cmd[1] == "train":
        return [sys.executable], cmd[2:]  # the console script runs slapo's own interpreter
    for i in range(1, len(cmd) - 2):
        if cmd[i] == "-m" and cmd[i + 1] in ("slapo", "slapo.cli") and cmd[i + 2] == "train":
            return cmd[:i], cmd[i + 3 :]
    return None


def check_launchable(command: Sequence[str]) -> None:
    """Raise ValueError when ``command`` starts processes itself: the tuner launches the layout's.

    Example:
        >>> check_launchable(["torchrun", "--nproc-per-node", "2", "-m", "slapo", "train"])
        Traceback (most recent call last):
        slapo.tune.errors.TuneValueError: ... drop the launcher: ...
    """
    for i, tok in enumerate(command):
        launcher = os.path.basename(tok) == "torchrun" or (
            i > 0 and command[i - 1] == "-m" and tok in _LAUNCHERS
        )
        if launcher:
            raise TuneValueError(
                f"the command runs under {tok}, and the tuning space has layout symbols "
                f"({', '.join(LAYOUT_SYMBOLS)}): drop the launcher: slapo tune starts each "
                "trial on dp * pp * cp * tp processes"
            )


def launch_argv(
    command: Sequence[str], cfg: Mapping[str, Value], *, port: int | None = None
) -> list[str]:
    """The argv of a trial of ``cfg``: ``command`` and the configuration's flags, under torchrun
    on :func:`layout_processes` processes when ``cfg`` holds layout symbols. ``port`` is the
    rendezvous port (default: :func:`free_port`).

    Example:
        >>> launch_argv(["python", "train.py"], {"batch_size": 8})
        ['python', 'train.py', '--batch-size', '8']
        >>> launch_argv(["./train.sh"], {"dp": 2}, port=29500)[3:]  # doctest: +NORMALIZE_WHITESPACE
        ['--nproc-per-node', '2', '--master-port', '29500', '--no-python', './train.sh']
    """
    procs = layout_processes(cfg, command)
    if procs is None:
        return [*command, *config_to_flags(cfg)]
    check_launchable(command)
    port = free_port() if port is None else port
    run = ["-m", "torch.distributed.run", "--nproc-per-node", str(procs)]
    run += ["--master-port", str(port)]
    split = _slapo_train_split(command)
    if split is not None:
        python, train_args = split
        return [*python, *run, "-m", "slapo", "train", *train_args, *trial_flags(cfg)]
    return [sys.executable, *run, "--no-python", *command, *trial_flags(cfg)]
