"""Byte units of the memory planner: sizes as people write them (``"8GiB"``) and as it prints
them, and the block sizes of CUDA's caching allocator (:func:`allocator_rounding`).

Example:
    >>> format_bytes(parse_bytes("1.5MiB"))
    '1.50 MiB'
    >>> allocator_rounding([100, 3 * 2**20])     # a 512 B block; a segment rounded to 2 MiB
    1048988
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from ..exceptions import SlapoError

__all__ = [
    "ALLOCATOR_MIN_BLOCK",
    "ALLOCATOR_SEGMENT",
    "ALLOCATOR_SMALL_SIZE",
    "MemorySizeError",
    "RESERVED_ALLOWANCE",
    "allocator_rounding",
    "format_bytes",
    "memory_size_arg",
    "parse_bytes",
    "reserved_bytes",
]

#: CUDA's caching allocator (``c10/cuda/CUDACachingAllocator.cpp``) rounds every request up to
#: a multiple of 512 bytes (``kMinBlockSize``) ...
ALLOCATOR_MIN_BLOCK = 512
#: ... packs the requests of 1 MiB or less (``kSmallSize``) into 2 MiB segments ...
ALLOCATOR_SMALL_SIZE = 2**20
#: ... and gives a larger one a segment of its own, rounded up to 2 MiB (``kRoundLarge``; the
#: 1 to 10 MiB requests share 20 MiB segments, which this rule does not model).
ALLOCATOR_SEGMENT = 2 * 2**20
#: What the cache keeps reserved beyond the blocks in use at the peak: freed blocks that a later,
#: differently sized request could not reuse (fragmentation). A stated allowance, not a
#: measurement: 5% of the rounded bytes.
RESERVED_ALLOWANCE = 0.05


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
        >>> import argparse
        >>> parser = argparse.ArgumentParser()
        >>> _ = parser.add_argument("--memory-budget", type=memory_size_arg)
        >>> parser.parse_args(["--memory-budget", "8GiB"]).memory_budget
        8589934592
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


def _round_up(nbytes: int, multiple: int) -> int:
    return -(-nbytes // multiple) * multiple


def allocator_rounding(sizes: Iterable[int]) -> int:
    """The bytes CUDA's caching allocator adds to tensors of ``sizes`` bytes: each request of
    1 MiB or less rounded up to 512 bytes (its block in a shared 2 MiB segment), each larger one
    rounded up to 2 MiB (a segment of its own). The small blocks' segments are rounded once, for
    all tensors together, by :func:`reserved_bytes`.

    Example:
        >>> allocator_rounding([100, 512, 2**20 + 1]) == 412 + 2**20 - 1
        True
    """
    added = 0
    for nbytes in sizes:
        if nbytes <= 0:
            continue
        step = ALLOCATOR_MIN_BLOCK if nbytes <= ALLOCATOR_SMALL_SIZE else ALLOCATOR_SEGMENT
        added += _round_up(nbytes, step) - nbytes
    return added


def reserved_bytes(allocated: int, rounding: int = 0) -> int:
    """What CUDA's caching allocator reserves to hold ``allocated`` bytes of tensors whose block
    sizes add ``rounding`` (:func:`allocator_rounding`): those blocks plus
    :data:`RESERVED_ALLOWANCE` for fragmentation, in whole 2 MiB segments (the last one the
    small blocks' shared segments).

    Example:
        >>> reserved_bytes(100 * 2**20) == 106 * 2**20     # 105 MiB, rounded to 2 MiB
        True
    """
    blocks = allocated + max(rounding, 0)
    return _round_up(math.ceil(blocks * (1 + RESERVED_ALLOWANCE)), ALLOCATOR_SEGMENT)
