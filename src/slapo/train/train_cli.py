"""``slapo train``: the command line, generated from the fields of :class:`TrainConfig`.

Each field becomes ``--field-name`` with the help, choices and group of its metadata; a bool
field takes an optional value (``--fuse-ops``, ``--fuse-ops false``), or is ``--no-<name>`` when it
defaults to True (``--no-progress``).

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser(); _ = add_parser(parser.add_subparsers())
    >>> parser.parse_args(["train", "--batch-size", "4"]).batch_size
    4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from collections.abc import Mapping, Sequence
from dataclasses import Field, fields
from typing import Any, get_type_hints

import torch.distributed as dist

from ..exceptions import ConfigError, SlapoError
from ..tune.memory_budget import Estimator, register_command_estimator, train_argv
from ..tune.space import Value
from ..tune.trial import config_to_flags
from .config import InputError, TrainConfig
from .loop import train
from .model_source import model_label
from .report import format_summary
from .run_memory import estimate_config

__all__ = [
    "add_parser", "config_from_args", "train_estimator", "trial_config",
]  # fmt: skip

HELP = "train a transformers model (yours, or a small one) on your data or the embedded corpus"
DESCRIPTION = """The main job: train a small transformers model on the embedded corpus with a
ready schedule, or your model (--model DIR) on your data (--data FILE|DIR), with the family's
ready schedule or else a generic plan. Under torchrun --nproc-per-node N it runs tensor (--tp),
data (--target ddp|fsdp), pipeline (--pp P), context (--cp C) and expert (--ep E) parallel, in any
mix: dp = N / (tp * pp * cp), ep borrowed from dp x cp. --save writes a Hugging Face model
directory that --resume continues exactly. Bad input exits with status 2."""


def parse_bool(text: str) -> bool:
    """A bool flag's optional value: 1/true/yes/on or 0/false/no/off.

    Example:
        >>> parse_bool("off")
        False
    """
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _value_type(hint: Any) -> Any:
    """``int`` for ``int``, ``str`` for ``str | None``: what the flag's text is parsed into."""
    if isinstance(hint, types.UnionType):
        (hint,) = (a for a in hint.__args__ if a is not type(None))
    return hint


def _add_flag(parser: Any, f: Field, hint: Any) -> None:
    meta, flag = f.metadata, "--" + f.name.replace("_", "-")
    flags = (flag, *meta.get("aliases", ()))
    kind = _value_type(hint)
    if kind is bool and f.default:
        # default SUPPRESS: no "(default: True)" in the help of a flag that turns it off
        parser.add_argument(
            "--no-" + flag[2:],
            dest=f.name,
            action="store_false",
            default=argparse.SUPPRESS,
            help=meta["help"],
        )
    elif kind is bool:
        parser.add_argument(
            flag, type=parse_bool, nargs="?", const=True, default=f.default, help=meta["help"]
        )
    else:
        # choices are checked by TrainConfig.check, not argparse: a bad one is then one line
        # naming the flag (exit status 2), not argparse's usage text
        choices = meta.get("choices")
        parser.add_argument(
            *flags,
            type=meta.get("parse") or kind,
            metavar="{" + ",".join(choices) + "}" if choices else None,
            default=f.default,
            help=meta["help"],
        )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``slapo train`` on an argparse subparsers object.

    Example:
        >>> add_parser(argparse.ArgumentParser().add_subparsers()).prog.endswith("train")
        True
    """
    p = subparsers.add_parser(
        "train", help=HELP, description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    hints = get_type_hints(TrainConfig)
    groups: dict[str, Any] = {}
    for f in fields(TrainConfig):
        group = f.metadata.get("group")
        where = p if group is None else groups.setdefault(group, p.add_argument_group(group))
        _add_flag(where, f, hints[f.name])
    p.add_argument(
        "--json", action="store_true",
        help='end with one JSON line {"throughput": tokens/s, ...} (what `slapo tune` reads)',
    )  # fmt: skip
    p.set_defaults(func=_run)
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``slapo train`` arguments.

    Example:
        >>> import argparse
        >>> parser = argparse.ArgumentParser(); _ = add_parser(parser.add_subparsers())
        >>> config_from_args(parser.parse_args(["train", "--no-progress"])).progress
        False
    """
    return TrainConfig(**{f.name: getattr(args, f.name, f.default) for f in fields(TrainConfig)})


def default_run_dir(cfg: TrainConfig) -> str:
    """Where a ``slapo train`` run without ``--output-dir`` writes: ``runs/<model>-<time>``
    (a model directory's own name for ``<model>``).

    Example:
        >>> default_run_dir(TrainConfig(model="gpt2")).startswith("runs/gpt2-")
        True
    """
    return f"runs/{model_label(cfg.model)}-{time.strftime('%Y%m%d-%H%M%S')}"


def _run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if cfg.output_dir is None:
        cfg.output_dir = default_run_dir(cfg)
    finished = False
    try:
        summary = train(cfg)
        finished = True
    except InputError as exc:  # bad input: one line, the usage-error status, no traceback
        message = " ".join(str(exc).split())  # one line, whatever a library put in it
        print(f"slapo train: {message}", file=sys.stderr)
        raise SystemExit(2) from exc
    except SlapoError as exc:
        raise SystemExit(f"slapo train: {exc}") from exc
    finally:
        if dist.is_available() and dist.is_initialized():
            if finished:  # every rank done with its collectives before any tears its group down
                dist.barrier()
            dist.destroy_process_group()
    if summary["world_size"] == 1 or int(os.environ.get("RANK", "0")) == 0:
        print(format_summary(summary))
        print(f"\nmetrics.json and loss.png: {cfg.output_dir}")
        if args.json:
            keys = ("final_loss", "peak_memory_mb", "tokens_per_s")
            print(
                json.dumps({"throughput": summary["tokens_per_s"], **{k: summary[k] for k in keys}})
            )
    return 0


@register_command_estimator
def train_estimator(command: Sequence[str]) -> Estimator | None:
    """The estimator of a ``slapo train`` command (None for any other command).

    ``estimate(cfg)`` parses the command's flags followed by the configuration's, as the trial
    will run them, and estimates that run: on the configuration's ``dp`` replicas (a layout
    symbol, not a flag: the processes the tuner launches beyond ``tp * pp``), for the rank that
    needs the most.

    Example:
        >>> estimate = train_estimator(["slapo", "train", "--model", "opt"])
        >>> estimate({"ckpt_ratio": 1.0}).required > 0
        True
        >>> estimate({"dp": 2, "pp": 2}).layout  # one rank of the 4 the trial runs on
        {'dp': 2, 'pp': 2, 'tp': 1}
    """
    argv = train_argv(command)
    if argv is None:
        return None

    def estimate(cfg: Mapping[str, Value]) -> Any:
        train_cfg, dp = trial_config(argv, cfg)
        return estimate_config(train_cfg, dp=dp)

    return estimate


def trial_config(argv: Sequence[str], cfg: Mapping[str, Value]) -> tuple[TrainConfig, int | None]:
    """The :class:`TrainConfig` a tuning trial runs (``slapo train``'s flags ``argv`` followed by
    the configuration's) and its ``dp`` replicas (a layout symbol, not a flag: the processes the
    tuner launches beyond ``tp * pp * cp``; None when the configuration has none).

    Example:
        >>> trial_config(["--model", "opt"], {"dp": 2, "tp": 2})[0].tp
        2
    """
    # dp is no flag: the tuner launches dp * tp * pp processes (slapo.tune.launch)
    dp = cfg.get("dp")
    flags = config_to_flags({k: v for k, v in cfg.items() if k != "dp"})
    parser = argparse.ArgumentParser(prog="slapo", exit_on_error=False)
    add_parser(parser.add_subparsers(dest="command"))
    try:
        args = parser.parse_args(["train", *argv, *flags])
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ConfigError(f"the trial's slapo train flags do not parse: {exc}") from exc
    train_cfg = config_from_args(args)
    try:
        train_cfg.check()
    except InputError as exc:  # as argparse's own errors above
        raise ConfigError(f"the trial's slapo train flags do not parse: {exc}") from exc
    return train_cfg, None if dp is None else int(dp)
