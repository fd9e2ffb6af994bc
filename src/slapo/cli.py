"""The ``slapo`` command: ``slapo train``, ``tune``, ``estimate``, ``plan``, ``primitives``."""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
import types
from dataclasses import fields, replace
from typing import Any, get_type_hints

from . import __version__
from .exceptions import SlapoError
from .plan.plan_cli import add_parser as add_plan
from .primitives import list_primitives
from .train import TrainConfig
from .train import add_parser as add_train
from .train.train_cli import parse_bool
from .tune.tune_cli import add_parser as add_tune


def _primitives(args: argparse.Namespace) -> int:
    for name, cls in list_primitives(name_only=False).items():
        doc = inspect.getdoc(cls) or ""
        print(f"{name:<20} {doc.splitlines()[0] if doc else ''}")
        if args.verbose:
            print("    " + doc.replace("\n", "\n    ") + "\n")
    return 0


ESTIMATE_HELP = "predict the memory of one training step of slapo train, allocating nothing"
ESTIMATE_DESCRIPTION = """Predict the peak memory of one training step of the model, schedule,
optimizer and batch that `slapo train` builds from the same flags, without allocating it: the step
runs on fake tensors (slapo.estimate_memory). A layout of --dp x --pp x --cp x --tp processes is
estimated for one of them (--rank R, on the ("dp", "pp", "cp", "tp") mesh) under the --target
engine: FSDP and ZeRO shards, a pipeline stage with the microbatches its schedule keeps in flight,
tensor-parallel shards, a context-parallel rank's --seq-len / --cp tokens (with the keys and values
its attention gathers), an expert-parallel rank's experts (--ep), RoundPipe's device-resident
bytes (slapo.estimate_layout). --precision bf16 or fp16 keeps
float32 master weights and optimizer state as each engine does; --device cuda estimates for a GPU
(also on a machine without one) and adds what CUDA's caching allocator reserves. --model takes a
directory holding only config.json: no weights are read."""
#: The ``slapo train`` flags that shape the estimated step: these and every schedule knob.
ESTIMATE_FLAGS = (
    "model", "preset", "batch_size", "seq_len", "seed", "unscheduled", "target", "num_microbatches",
    "device", "precision",
)  # fmt: skip


def _estimate_fields() -> list[Any]:
    from .train.config import SCHEDULE_KNOBS

    return [
        f for f in fields(TrainConfig)
        if f.name in ESTIMATE_FLAGS or f.metadata.get("group") == SCHEDULE_KNOBS
    ]  # fmt: skip


def _add_estimate(sub: Any) -> None:
    from .memory import PIPELINE_SCHEDULES, memory_size_arg  # light: fake tensors load later

    p = sub.add_parser(
        "estimate", help=ESTIMATE_HELP, description=ESTIMATE_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    hints = get_type_hints(TrainConfig)
    for f in _estimate_fields():
        kind, meta = hints[f.name], f.metadata
        if isinstance(kind, types.UnionType):  # str | None -> str
            (kind,) = (a for a in kind.__args__ if a is not type(None))
        flag = "--" + f.name.replace("_", "-")
        if kind is bool and f.default:  # as slapo train: --no-<name> turns it off
            p.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=meta["help"])
        elif kind is bool:
            p.add_argument(flag, type=parse_bool, nargs="?", const=True, default=f.default,
                           help=meta["help"])  # fmt: skip
        else:
            p.add_argument(flag, type=meta.get("parse") or kind, choices=meta.get("choices"),
                           default=f.default, help=meta["help"])  # fmt: skip
    p.add_argument(
        "--dp", type=int, default=1,
        help="data-parallel replicas (--batch-size is each one's); the total is dp x pp x cp x tp",
    )  # fmt: skip
    p.add_argument(
        "--rank", type=int, default=0,
        help='the estimated process\'s rank on the ("dp", "pp", "cp", "tp") mesh: '
        "((dp_rank x pp + stage) x cp + cp_rank) x tp + tp_rank",
    )  # fmt: skip
    p.add_argument(
        "--pipeline-schedule", choices=PIPELINE_SCHEDULES, default="1F1B",
        help="with --pp: the microbatches in flight (GPipe: all; 1F1B: pp - stage at most)",
    )  # fmt: skip
    p.add_argument(
        "--optimizer", choices=("adamw", "adam", "sgd", "none"), default="adamw",
        help="whose state counts (slapo train uses adamw)",
    )  # fmt: skip
    p.add_argument("--momentum", type=float, default=0.0, help="with --optimizer sgd")
    p.add_argument("--compare", action="store_true", help="also estimate the unscheduled model")
    p.add_argument(
        "--memory-budget", type=memory_size_arg, default=None, metavar="SIZE",
        help="say whether the step fits SIZE (e.g. 8GiB); exit 1 when it does not",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON line instead of tables")
    p.set_defaults(func=_estimate)


def _estimate(args: argparse.Namespace) -> int:
    from .memory import format_bytes
    from .train.run_memory import estimate_config

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in _estimate_fields()})
    optimizer = {"adamw": None, "adam": "adam", "sgd": "sgd", "none": "none"}[args.optimizer]
    kwargs = {"lr": 0.1, "momentum": args.momentum} if args.optimizer == "sgd" else {}
    runs = {"unscheduled": True, "scheduled": cfg.unscheduled} if args.compare else {"": None}
    ests = {}
    try:
        for label, unscheduled in runs.items():
            run_cfg = cfg if unscheduled is None else replace(cfg, unscheduled=unscheduled)
            ests[label] = estimate_config(
                run_cfg, args.rank, optimizer, kwargs, args.dp, args.pipeline_schedule
            )
    except SlapoError as exc:
        raise SystemExit(f"slapo estimate: {exc}") from exc
    last = ests[list(ests)[-1]]
    fits = None if args.memory_budget is None else last.required <= args.memory_budget
    if args.json:
        doc = {k or "estimate": e.as_dict() for k, e in ests.items()}
        if fits is not None:
            doc["fits_memory_budget"] = fits
        print(json.dumps(doc))
        return 0 if fits in (None, True) else 1
    from .train.job_layout import schedule_knobs

    world = args.dp * cfg.pp * cfg.cp * cfg.tp
    tp = f", {last.target} rank {args.rank} of {world}" if world > 1 else ""
    knobs = schedule_knobs(cfg)
    from .train.presets import MODELS

    # a model directory has its own size; a family or a model type is --preset's
    sized = "" if cfg.model not in MODELS and os.path.isdir(cfg.model) else f" ({cfg.preset})"
    print(
        f"slapo estimate: {cfg.model}{sized}, batch {cfg.batch_size} x {cfg.seq_len} "
        f"tokens, ckpt_ratio {knobs['ckpt_ratio']}, ckpt_policy {knobs.get('ckpt_policy')}{tp}, "
        f"optimizer {args.optimizer}, {last.precision} on {last.device}"
    )
    if len(ests) == 1:
        print(last)
    else:
        rows = [("parameters", "params"), ("buffers", "buffers"), ("gradients", "grads"),
                ("optimizer state", "optimizer_state"), ("activations", "activations"),
                ("peak (all of the above)", "peak"), ("live peak (with temporaries)", "live_peak"),
                ("required (larger of the two)", "required")]  # fmt: skip
        if last.device == "cuda":
            rows.append(("reserved (CUDA allocator)", "reserved"))
        print(f"{'':<30}" + "".join(f"{label:>14}" for label in ests))
        for name, attr in rows:
            cells = "".join(f"{format_bytes(getattr(e, attr)):>14}" for e in ests.values())
            print(f"{name:<30}{cells}")
    if fits is not None:
        verdict = "fits" if fits else "does NOT fit"
        print(f"{verdict} the memory budget of {format_bytes(args.memory_budget)}")
    return 0 if fits in (None, True) else 1


def build_parser() -> argparse.ArgumentParser:
    """The ``slapo`` argument parser with its subcommands.

    Example:
        >>> build_parser().parse_args(["primitives", "-v"]).verbose
        True
    """
    parser = argparse.ArgumentParser(
        prog="slapo", description="Slapo: schedule and train PyTorch models."
    )
    parser.add_argument("--version", action="version", version=f"slapo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_train(sub)
    prims = sub.add_parser("primitives", help="list the schedule primitives")
    prims.add_argument("-v", "--verbose", action="store_true", help="print each primitive's help")
    prims.set_defaults(func=_primitives)
    add_tune(sub)
    _add_estimate(sub)
    add_plan(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``slapo`` console command.

    Example:
        >>> main(["primitives"])  # one line per primitive, then the exit status
        annotate ...
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


def console_main() -> None:
    """The ``slapo`` command and ``python -m slapo``: :func:`main`, then exit with its status.

    A process of a distributed run (``WORLD_SIZE`` > 1, as under torchrun) that finished leaves
    without the interpreter's finalization (``os._exit`` once its output is flushed): a gloo
    worker thread still dropping the tensors of a finished collective needs the GIL to do it,
    and a thread asking for the GIL while the interpreter finalizes is unwound through a C++
    destructor, which aborts the process ("terminate called without an active exception")
    although the run succeeded. Nothing of ours runs at exit: every file is closed by then.
    """
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
