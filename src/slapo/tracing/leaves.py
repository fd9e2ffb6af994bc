"""``leaves=``: the submodules a trace keeps as calls of the original module, and their check."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

from torch import nn

from ..surgery import label
from .errors import LeafError

__all__ = ["Leaves", "check_leaves", "is_leaf"]

Leaves = Sequence[str | type]


def _matches(leaf: str | type, path: str, mod: nn.Module) -> bool:
    if isinstance(leaf, type):
        return isinstance(mod, leaf)
    return leaf in (path, type(mod).__name__) or re.fullmatch(leaf, path) is not None


def is_leaf(path: str, mod: nn.Module, leaves: Leaves) -> bool:
    """Whether the submodule ``mod`` at ``path`` matches an entry of ``leaves``.

    Example:
        >>> is_leaf("layers.0", nn.Linear(2, 2), ["Linear"]), is_leaf("x", nn.ReLU(), [r"y.*"])
        (True, False)
    """
    return any(_matches(leaf, path, mod) for leaf in leaves)


def check_leaves(mod: nn.Module, leaves: Leaves, path: str = "") -> None:
    """Raise :class:`LeafError` unless every entry of ``leaves`` can match a submodule of ``mod``.

    A string entry must be a submodule path (relative to ``mod``, or to any of its descendants,
    as the hierarchical fx trace matches at every level), a class name, or a regex that fully
    matches such a path; a class entry needs no submodule (it may be a generic choice).

    Example:
        >>> check_leaves(nn.Sequential(nn.Linear(2, 2)), ["0", "Linear", "[0-9]+", nn.ReLU])
        >>> check_leaves(nn.Sequential(nn.Linear(2, 2)), ["1"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        slapo.tracing.errors.LeafError: trace of "<root>" (Sequential): leaves entry '1' names no ...
    """
    where = f'"{label(path)}" ({type(mod).__name__})'
    if isinstance(leaves, str | type):
        raise LeafError(
            f"trace of {where}: leaves must be a list of module paths, regexes, class names or "
            f"classes, got leaves={leaves!r}; write leaves=[{leaves!r}]"
        )
    named = [(n, m) for n, m in mod.named_modules() if n]
    # Every dotted suffix of every path: "layers.0.attn" is also "0.attn" and "attn" one level
    # down, where the hierarchical fx trace matches leaves again.
    suffixes = {".".join(n.split(".")[i:]) for n, _ in named for i in range(n.count(".") + 1)}
    classes = {type(m).__name__ for _, m in named}
    for leaf in leaves:
        if isinstance(leaf, type):
            continue
        if not isinstance(leaf, str):
            raise LeafError(
                f"trace of {where}: leaves entries are module paths, regexes, class names or "
                f"classes, got a {type(leaf).__name__} object; give its path or its class"
            )
        if leaf in suffixes or leaf in classes:
            continue
        try:
            regex: re.Pattern[str] | None = re.compile(leaf)
            bad_regex = ""
        except re.error as exc:
            regex, bad_regex = None, f" (and not a valid regex: {exc})"
        if regex is not None and any(regex.fullmatch(s) for s in suffixes):
            continue
        close = difflib.get_close_matches(leaf, sorted(suffixes | classes), n=3, cutoff=0.6)
        paths = [n for n, _ in named]
        shown = ", ".join(paths[:12]) + (f", ... {len(paths) - 12} more" if paths[12:] else "")
        raise LeafError(
            f"trace of {where}: leaves entry {leaf!r} names no submodule: it is not a module "
            f"path, a class name, or a regex matching a path{bad_regex}."
            + (f" Did you mean {', '.join(map(repr, close))}?" if close else "")
            + f" Module paths: {shown or '(none)'}. Class names: "
            f"{', '.join(sorted(classes)) or '(none)'}."
        )
