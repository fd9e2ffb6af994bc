"""Atomic checkpoint directories: write into ``<path>.tmp-slapo``, then swap it in.

The swap renames ``<path>`` -> ``<path>.old-slapo``, then ``<path>.tmp-slapo`` -> ``<path>``,
then removes the old copy, so a killed save never leaves a ``<path>`` that loads. A crash
between the two renames leaves no ``<path>`` but two complete copies: :func:`locate` loads the
newer (``.tmp-slapo``, else ``.old-slapo``) with a logged warning, and the next save finishes
the swap first (:func:`begin_save`).

Example:
    >>> from pathlib import Path
    >>> from slapo.checkpoints.atomic import TMP, begin_save, replace_dir, sibling
    >>> from slapo.checkpoints.format import FORMAT, MARKER, write_json
    >>> path = Path("ckpt")
    >>> tmp = sibling(path, TMP)
    >>> begin_save(path, tmp)          # an empty tmp, an interrupted swap finished
    >>> write_json(tmp / MARKER, {"format": FORMAT})  # write the files and the marker into tmp
    >>> replace_dir(tmp, path)
    >>> sorted(p.name for p in path.iterdir())
    ['slapo_checkpoint.json']
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..logger import get_logger
from .format import MARKER, CheckpointError, fsync, read_marker

__all__ = ["OLD", "TMP", "begin_save", "is_complete", "locate", "replace_dir", "sibling"]

TMP, OLD = ".tmp-slapo", ".old-slapo"


def sibling(path: Path, suffix: str) -> Path:
    """``path`` with ``suffix`` appended to its name: ``ckpt`` -> ``ckpt.tmp-slapo``.

    Example:
        >>> sibling(Path("out/ckpt"), TMP).name
        'ckpt.tmp-slapo'
    """
    return path.with_name(path.name + suffix)


def is_complete(root: Path) -> bool:
    """Whether ``root`` holds the marker a finished save writes last."""
    return (root / MARKER).is_file()


def begin_save(
    path: Path, tmp: Path, old: str = OLD, complete: Callable[[Path], bool] = is_complete
) -> None:
    """Finish a swap a crash interrupted (no ``path``, a ``complete`` copy beside it), then
    start an empty ``tmp``.

    Example:
        >>> begin_save(Path("ckpt"), Path("ckpt.tmp-slapo"))
    """
    if not path.exists():
        for copy in (tmp, sibling(path, old)):
            if complete(copy):
                os.rename(copy, path)
                get_logger().warning(
                    "%s was missing after an interrupted save; restored it from %s", path, copy
                )
                break
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def replace_dir(
    src: Path, dst: Path, old: str = OLD, carry: Callable[[Path, Path], None] | None = None
) -> None:
    """Swap the complete directory ``src`` in as ``dst``; the old ``dst`` goes aside, then away.

    ``carry(old_dst, src)`` runs before the swap, to move what the new copy keeps of the old
    one (``slapo train``'s step checkpoints inside a final save).

    Example:
        >>> replace_dir(Path("ckpt.tmp-slapo"), Path("ckpt"))
    """
    aside = sibling(dst, old)
    if dst.exists():
        if carry is not None:
            carry(dst, src)
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(dst, aside)
    os.rename(src, dst)
    fsync(dst.parent)
    shutil.rmtree(aside, ignore_errors=True)


def locate(path: Path) -> tuple[Path, dict[str, Any]]:
    """The complete copy to load for ``path`` and its marker, recovering an interrupted swap.

    Example:
        >>> from slapo.checkpoints.format import FORMAT, MARKER, write_json
        >>> Path("saved").mkdir()
        >>> write_json(Path("saved") / MARKER, {"format": FORMAT})
        >>> root, marker = locate(Path("saved"))  # saved.tmp-slapo when a swap was cut short
        >>> root.name, marker["format"]
        ('saved', 'slapo-safetensors-v1')
    """
    if is_complete(path):
        return path, read_marker(path)
    tmp, old = sibling(path, TMP), sibling(path, OLD)
    if not path.exists():
        for copy, which in ((tmp, "the newer"), (old, "the previous")):
            if is_complete(copy):
                marker = read_marker(copy)
                get_logger().warning(
                    "%s is missing: a save was interrupted between its two renames. Loading %s "
                    "complete copy %s instead; the next save to %s finishes the swap.",
                    path, which, copy, path,
                )  # fmt: skip
                return copy, marker
        if not tmp.exists() and not old.exists():
            raise CheckpointError(f"no such checkpoint: {path}")
    if path.is_file():
        raise CheckpointError(
            f"{path} is a file, not a Slapo checkpoint directory (an older Slapo wrote pickles with "
            "torch.save; they can run code when loaded, so Slapo no longer reads them)"
        )
    extra = f" (an interrupted save left {tmp})" if tmp.exists() else ""
    if (path / ".metadata").exists():
        extra += "; its torch.distributed.checkpoint .metadata is a pickle, which Slapo never reads"
    raise CheckpointError(
        f"{path} is not a complete Slapo checkpoint: {MARKER} is missing{extra}; "
        "a save that did not finish never produces a loadable checkpoint"
    )
