"""The library's logger, which can speak on chosen ranks only.

``get_logger().info(msg, ranks=0)`` logs on rank 0 alone, ``ranks=[0, 1]`` on those two; without
``ranks`` every process logs. The rank is the global one of ``torch.distributed`` when a process
group is running, else 0.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

from .ranks import get_rank

__all__ = ["RankLogger", "get_logger"]

_FORMAT = "[%(asctime)s %(name)s %(levelname)s] %(message)s"

Ranks = int | Iterable[int] | None


class RankLogger(logging.Logger):
    """A ``logging.Logger`` whose logging calls take ``ranks=``: the ranks that log the record.

    Example:
        >>> logger = get_logger()
        >>> logger.info("printed once, by rank 0", ranks=0)
        >>> logger.warning("printed by ranks 0 and 1", ranks=[0, 1])
    """

    def _log(
        self,
        level: int,
        msg: object,
        args: Any,
        exc_info: Any = None,
        extra: Any = None,
        stack_info: bool = False,
        stacklevel: int = 1,
        ranks: Ranks = None,
    ) -> None:
        # Every logging method (debug, info, ..., log, exception) ends here, so one override
        # serves them all; stacklevel + 1 skips this frame when the record finds its caller.
        if ranks is not None and not _selected(ranks):
            return
        super()._log(level, msg, args, exc_info, extra, stack_info, stacklevel + 1)


@functools.cache
def _with_ranks(cls: type[logging.Logger]) -> type[RankLogger]:
    """``RankLogger``, or for a Logger subclass (the root logger's) one that is both."""
    if cls is logging.Logger:
        return RankLogger
    return type(f"Rank{cls.__name__}", (RankLogger, cls), {})


def _selected(ranks: int | Iterable[int]) -> bool:
    rank = get_rank()
    return rank == ranks if isinstance(ranks, int) else rank in set(ranks)


def get_logger(name: str = "Slapo", level: int = logging.INFO) -> RankLogger:
    """Attach to the default logger, with one stream handler however often it is called.

    Its logging calls take ``ranks=`` (an int or a list of ints): only those ranks log.

    Example:
        >>> logger = get_logger()
        >>> logger.name
        'Slapo'
        >>> logger.info("only rank 0 says this", ranks=0)
    """
    logger = logging.getLogger(name)
    if not isinstance(logger, RankLogger):
        # The logger may exist already (logging.getLogger("Slapo") before slapo's first call):
        # give that very object the ranks= argument, so handlers and levels set on it stay.
        logger.__class__ = _with_ranks(type(logger))
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    return logger  # type: ignore[return-value]  (its class was made RankLogger above)
