"""Byte units of the memory planner: sizes as people write them (``"8GiB"``) and as it prints them.

Example:
    >>> format_bytes(parse_bytes("1.5MiB"))
    '1.50 MiB'
"""

from __future__ import annotations

import re

from ..exceptions import SlapoError

__all__ = ["MemorySizeError", "format_bytes", "memory_size_arg", "parse_bytes"]


class MemorySizeError(SlapoError, ValueError):
    """A memory size (``--memory-budget``) that does not parse, e.g. ``8 gigs``."""


_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(size: int | float | str) -> int:
    """A memory size in bytes: an int, or text such as ``"8GiB"``, ``"512 MB"``, ``"1.5g"``.

    ``KiB``/``MiB``/``GiB``/``TiB`` and a bare ``K``/``M``/``G``/``T`` are powers of 1024;
    ``KB``/``MB``/``GB``/``TB`` powers of 1000.

    Example:
        >>> parse_bytes("8GiB"), parse_bytes("1.5k"), parse_bytes(4096)
        (8589934592, 1536, 4096)
    """
    if isinstance(size, bool):
        raise MemorySizeError(
            f"a memory size must be a number of bytes or text like 8GiB, got {size!r}"
        )
    if isinstance(size, (int, float)):
        value, unit = float(size), ""
    else:
        match = _SIZE.match(str(size))
        if not match or match.group(2).lower() not in _UNITS:
            raise MemorySizeError(
                f"cannot read {size!r} as a memory size: write a number of bytes or a number "
                "with a unit, e.g. 8GiB, 512MiB, 2GB (KiB/MiB/GiB/TiB or K/M/G/T: powers of "
                "1024; KB/MB/GB/TB: powers of 1000)"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    nbytes = value * _UNITS[unit]
    if not nbytes > 0 or nbytes != nbytes:
        raise MemorySizeError(f"a memory size must be positive, got {size!r}")
    return int(nbytes)


def memory_size_arg(text: str) -> int:
    """:func:`parse_bytes` as an ``argparse`` type: a bad size is a usage error that says why.

    Example:
        >>> argparse.ArgumentParser().add_argument("--memory-budget", type=memory_size_arg)
    """
    import argparse

    try:
        return parse_bytes(text)
    except MemorySizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it at 1 or more.

    Example:
        >>> format_bytes(3 * 2**20), format_bytes(512)
        ('3.00 MiB', '512 B')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"
