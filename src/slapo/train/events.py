"""TensorBoard event files beside ``metrics.json``: the loss, learning rate and tokens/s of
every step and each evaluation, written with ``torch.utils.tensorboard.SummaryWriter``.

TensorBoard is optional (``pip install tensorboard``): without it a run notes so on stderr,
once, and writes ``metrics.json`` as always.

Example:
    >>> events = open_events(Path("runs/llama"), start=0)
    >>> events.add(1, {"train/loss": 5.2, "train/lr": 3e-3})
    >>> events.close()
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["Events", "open_events"]


class Events:
    """Scalars into one run directory's event file (a no-op without a writer).

    Example:
        >>> Events(None).add(1, {"train/loss": 5.2})   # nothing written
    """

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def add(self, step: int, scalars: dict[str, float]) -> None:
        """Record ``scalars`` at ``step`` (1-based: the steps done)."""
        if self.writer is None:
            return
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def open_events(out: Path | None, start: int) -> Events:
    """The event writer of a run directory (None: no directory, so none); a resumed run purges
    any events past ``start`` that an earlier run left there.

    Example:
        >>> open_events(None, 0).writer is None
        True
    """
    if out is None:
        return Events(None)
    try:  # deferred: tensorboard is optional, and slow to import
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print(
            "slapo train: no TensorBoard event files: tensorboard is not installed (pip "
            "install tensorboard; --no-tensorboard hides this note)",
            file=sys.stderr,
        )
        return Events(None)
    out.mkdir(parents=True, exist_ok=True)
    return Events(SummaryWriter(log_dir=str(out), purge_step=start + 1 if start else None))
