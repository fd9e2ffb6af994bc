"""The ``slapo`` command: ``slapo train``, ``slapo tune``, ``slapo primitives``."""

from __future__ import annotations

import argparse
import inspect
import sys

from . import __version__
from .primitives import list_primitives
from .train import add_parser as add_train
from .tune.cli import add_parser as add_tune


def _primitives(args: argparse.Namespace) -> int:
    for name, cls in list_primitives(name_only=False).items():
        doc = inspect.getdoc(cls) or ""
        print(f"{name:<20} {doc.splitlines()[0] if doc else ''}")
        if args.verbose:
            print("    " + doc.replace("\n", "\n    ") + "\n")
    return 0


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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``slapo`` console command.

    Example:
        >>> main(["primitives"])
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
