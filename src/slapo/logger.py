"""The library's logger."""

from __future__ import annotations

import logging

_FORMAT = "[%(asctime)s %(name)s %(levelname)s] %(message)s"


def get_logger(name: str = "Slapo", level: int = logging.INFO) -> logging.Logger:
    """Attach to the default logger, with one stream handler however often it is called.

    Example:
        >>> logger = get_logger()
        >>> logger.name
        'Slapo'
    """
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    return logger
