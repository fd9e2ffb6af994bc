"""``slapo tune``: search a space of training configurations with a real training command.

Example:
    slapo tune --config tune_cfg.py --db results.json --strategy bayes --budget 20 \\
        -- python train.py --model gpt2

The config file defines ``update_space(args, space)``; ``args`` holds the flags of the
training command (``--model gpt2`` -> ``args["model"] == args.model == "gpt2"``). With
``--memory-budget 8GiB``, configurations whose estimated memory exceeds it are skipped before any
trial runs: the config file's ``estimate_memory(args, cfg)`` estimates them, or, for a
``slapo train`` command, slapo itself (see :mod:`slapo.tune.memory_budget`; ``slapo tune`` registers
it, the standalone ``python -m slapo.tune.tune_cli`` does not).

Layouts are symbols too: a configuration with ``tp``, ``pp``, ``cp`` or ``dp`` runs its trial under
torchrun on ``dp * pp * cp * tp`` processes (:mod:`slapo.tune.launch`; ``--max-procs`` skips those
needing more), e.g. ``slapo tune --config examples/tune_layouts.py --db layouts.json
--memory-budget 32MiB -- slapo train --model llama --steps 20 --no-progress --json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from typing import Any

from ..memory import memory_size_arg
from .database import Database, DatabaseCorruptError
from .launch import layout_processes
from .memory_budget import Estimator, command_estimator, required_bytes
from .predict import command_predictor, rank_by_prediction
from .report import best_table, plot_search
from .space import Space, UpdateSpaceFn, config_key
from .strategies import STRATEGIES
from .tuner import DIRECTIONS, TuneError, Tuner, default_plot_path

HELP = "search training configurations (a space from --config) by running a command"


class TrainingArgs(dict):
    """The training command's flags, readable as ``args["name"]`` or ``args.name``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"the training command has no flag --{name.replace('_', '-')}"
            ) from None


def _convert(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_training_args(command: Sequence[str]) -> TrainingArgs:
    """Collect ``--name value``, ``--name=value`` and bare ``--flag`` (True) from a command.

    Example:
        >>> parse_training_args(["python", "train.py", "--gpus", "2", "--fp16", "--lr=1e-3"])
        {'gpus': 2, 'fp16': True, 'lr': 0.001}
    """
    args = TrainingArgs()
    i = 0
    while i < len(command):
        tok = command[i]
        if tok.startswith("--") and len(tok) > 2:
            name, eq, text = tok[2:].partition("=")
            key = name.replace("-", "_")
            if eq:
                args[key] = _convert(text)
            elif i + 1 < len(command) and not command[i + 1].startswith("--"):
                args[key] = _convert(command[i + 1])
                i += 1
            else:
                args[key] = True
        i += 1
    return args


def load_config(path: str) -> Any:
    """Import the config file at ``path``; returns the module."""
    if not os.path.isfile(path):
        raise TuneError(f"--config {path!r}: no such file")
    spec = importlib.util.spec_from_file_location("slapo_tune_config", path)
    if spec is None or spec.loader is None:
        raise TuneError(f"--config {path!r}: cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_update_space(path: str, module: Any = None) -> UpdateSpaceFn:
    """Import the config file at ``path`` (unless its ``module`` is given) and return its
    ``update_space`` function."""
    module = module if module is not None else load_config(path)
    fn = getattr(module, "update_space", None)
    if not callable(fn):
        raise TuneError(f"--config {path!r} must define a function update_space(args, space)")
    return fn


def _positive_int(text: str) -> int:
    val = int(text)
    if val < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return val


def find_estimator(config: Any, command: Sequence[str], args: TrainingArgs) -> Estimator:
    """``estimate(cfg)`` for ``--memory-budget``: the config file's ``estimate_memory(args,
    cfg)``, else slapo's own for a ``slapo train`` command; a clear error otherwise."""
    fn = getattr(config, "estimate_memory", None)
    if fn is not None:
        if not callable(fn):
            raise TuneError(
                "--config: estimate_memory must be a function estimate_memory(args, cfg)"
            )
        return lambda cfg: fn(args, dict(cfg))
    estimate = command_estimator(command)
    if estimate is None:
        raise TuneError(
            "--memory-budget needs an estimate of each configuration: the command is not "
            "`slapo train`, so define estimate_memory(args, cfg) in the --config file (returning "
            "bytes, a slapo.estimate_memory(...) result, or None when unknown)"
        )
    return estimate


def _predicted(
    args: argparse.Namespace, space: Any, command: Sequence[str], estimate: Estimator | None
) -> tuple[list[Any], Estimator | None, int | None]:
    """``--predict``: the space's configurations fastest predicted first, and (without a
    ``--memory-budget``) the device's memory as the budget, the predictions' estimates as the
    estimate. Raises :class:`TuneError` for a command the planner cannot predict."""
    found = command_predictor(command, args.predict)  # slapo.plan registers slapo train's
    if found is None:
        raise TuneError(
            "--predict needs a slapo train command (the planner predicts what slapo train builds)"
        )
    predict, capacity = found
    ranked, predictions = rank_by_prediction(list(space), predict)
    by_key = {config_key(cfg): predictions[i] for i, cfg in enumerate(ranked)}
    budget = args.memory_budget
    if budget is None:
        budget = capacity

        def estimate(cfg: Any) -> Any:
            pred = by_key.get(config_key(cfg))
            return None if pred is None else pred.memory_bytes

    return ranked, estimate, budget


def _positive_float(text: str) -> float:
    val = float(text)
    if not val > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return val


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``tune`` options and the trailing COMMAND to ``p``."""
    p.add_argument("--config", required=True, help="Python file defining update_space(args, space)")
    p.add_argument("--db", required=True, help="JSON file of results; reused to resume")
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="exhaustive")
    p.add_argument(
        "--budget",
        type=_positive_int,
        default=None,
        help="most configurations measured in total, earlier runs included",
    )
    p.add_argument("--objective", default="throughput", help="key of the trial's JSON result")
    p.add_argument("--direction", choices=DIRECTIONS, default="maximize")
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        help="seconds before a trial is killed and recorded as a timeout",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random and bayes strategies")
    p.add_argument("--top", type=_positive_int, default=5, help="rows of the best-config table")
    p.add_argument("--plot", default=None, help="PNG of the search (default: DB path, .png)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--dry-run", action="store_true", help="list the space and exit")
    p.add_argument(
        "--memory-budget",
        type=memory_size_arg,
        default=None,
        metavar="SIZE",
        help="skip, before any trial, the configurations whose estimated memory exceeds SIZE "
        "(bytes, or e.g. 8GiB, 512MB); --dry-run shows each estimate",
    )
    p.add_argument(
        "--max-procs",
        type=_positive_int,
        default=None,
        metavar="N",
        help="skip, before any trial, the layouts (tp, pp, dp symbols) that need more than N "
        "processes (dp * pp * cp * tp)",
    )
    p.add_argument(
        "--predict",
        default=None,
        metavar="DEVICE",
        help="run the trials the planner predicts fastest first, and skip those it predicts "
        "do not fit DEVICE's memory: a device preset (h100, a100, ...) or a device file "
        "(slapo plan --calibrate); slapo train commands only",
    )
    p.add_argument(
        "trial_command",
        metavar="COMMAND",
        nargs=argparse.REMAINDER,
        help="after --: the training command; each trial appends --name value flags",
    )
    p.set_defaults(func=run_tune)
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``tune`` on an ``argparse`` subparsers object (handler in ``func``).

    Example:
        >>> parser = argparse.ArgumentParser(prog="slapo")
        >>> _ = add_parser(parser.add_subparsers(dest="command"))
        >>> args = parser.parse_args(["tune", "--config", "c.py", "--db", "r.json", "--",
        ...                           "python", "train.py", "--lr", "0.1"])
        >>> args.func is run_tune, args.trial_command[-4:]
        (True, ['python', 'train.py', '--lr', '0.1'])
    """
    p = subparsers.add_parser("tune", help=HELP, description=HELP)
    return configure_parser(p)


def run_tune(args: argparse.Namespace) -> int:
    """Handle parsed ``tune`` arguments; return the exit code (0 ok, 1 no success, 2 misuse)."""
    command = list(args.trial_command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("slapo tune: error: give the training command after --", file=sys.stderr)
        return 2
    if shutil.which(command[0]) is None:
        print(f"slapo tune: error: command not found: {command[0]!r}", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
        update_space = load_update_space(args.config, config)
        training_args = parse_training_args(command)
        space = Space(update_space, training_args)
        estimate = None
        if args.memory_budget is not None:
            estimate = find_estimator(config, command, training_args)
        if args.predict is not None:
            space, estimate, args.memory_budget = _predicted(args, space, command, estimate)
        if args.dry_run:
            return _dry_run(space, estimate, args.memory_budget, command, args.max_procs)
        db = Database(args.db)
        tuner = Tuner(
            space,
            command,
            db,
            strategy=args.strategy,
            budget=args.budget,
            objective=args.objective,
            direction=args.direction,
            timeout=args.timeout,
            seed=args.seed,
            progress=not args.no_progress,
            memory_budget=args.memory_budget,
            estimate=estimate,
            max_procs=args.max_procs,
        )
    except (TuneError, DatabaseCorruptError, TypeError, ValueError) as e:
        print(f"slapo tune: error: {e}", file=sys.stderr)
        return 2
    print(
        f"slapo tune: {len(tuner.configs)} configurations, strategy {args.strategy}, "
        f"{len(tuner.records())} already measured in {args.db}",
        file=sys.stderr,
    )
    try:
        records = tuner.run()
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(
            f"slapo tune: interrupted ({signal.Signals(signum).name}); the running trial was "
            f"stopped, measured trials are saved in {args.db}; re-run to resume",
            file=sys.stderr,
        )
        return 128 + signum
    maximize = args.direction == "maximize"
    print(
        best_table(records, tuner.value, objective=args.objective, maximize=maximize, top=args.top)
    )
    skipped = tuner.skipped()
    if skipped:
        print(
            f"{len(skipped)} configurations skipped, never run: their estimated memory exceeds "
            f"--memory-budget or their layout --max-procs (reasons in {args.db})"
        )
    plot = args.plot or default_plot_path(args.db)
    if plot_search(
        records,
        tuner.value,
        plot,
        objective=args.objective,
        maximize=maximize,
        title=f"slapo tune ({args.strategy}): {' '.join(command)}"[:90],
    ):
        print(f"plot: {plot}")
    return 0 if tuner.best(1) else 1


def _dry_run(
    space: Space,
    estimate: Estimator | None,
    budget: int | None,
    command: Sequence[str] = (),
    max_procs: int | None = None,
) -> int:
    """List the space: each layout's processes; with a memory budget, each configuration's
    estimate and verdict (a layout over ``max_procs`` is skipped before it is estimated)."""
    cfgs = list(space)
    over = too_wide = 0
    for i, cfg in enumerate(cfgs):
        notes = []
        try:
            procs = layout_processes(cfg, command)
        except ValueError as exc:
            raise TuneError(str(exc)) from exc
        if procs is not None:
            notes.append(f"{procs} process" + ("es" if procs > 1 else ""))
        if procs is not None and max_procs is not None and procs > max_procs:
            too_wide += 1
            notes[-1] += f": over --max-procs {max_procs}, skipped"
        elif estimate is not None and budget is not None:
            from ..memory import format_bytes

            try:
                need = required_bytes(estimate(cfg))
            except Exception as exc:  # noqa: BLE001  (shown, as the tuner would run it)
                need, note = None, f"no estimate ({type(exc).__name__}: {exc}): runs"
            else:
                note = "no estimate: runs" if need is None else format_bytes(need)
            if need is not None and need > budget:
                over += 1
                note += ": over budget, skipped"
            notes.append(note)
        print(f"[{i}] {Space.cfg_dict_to_str(cfg)}" + (f"  [{'; '.join(notes)}]" if notes else ""))
    summary = f"{len(cfgs)} configurations" + (f", {over} over the memory budget" if budget else "")
    if max_procs is not None:
        summary += f", {too_wide} over --max-procs {max_procs}"
    print(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``tune`` as a standalone program (``python -m slapo.tune.tune_cli``)."""
    parser = configure_parser(argparse.ArgumentParser(prog="slapo tune", description=HELP))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
