"""Random streams of the runtime: one seed per (layer, microbatch), so a recompute replays the
forward's random numbers."""

from __future__ import annotations

__all__ = ["derive_seed"]


def derive_seed(base_seed: int, layer_id: int, microbatch_id: int) -> int:
    """Deterministic RNG seed for one (layer, microbatch) execution.

    RoundPipe seeds every layer call from this value when ``preserve_rng_state`` is on, so
    random ops (dropout) give the same result in forward and recompute, independently of
    how worker threads interleave.

    Example:
        >>> derive_seed(1, 2, 3) == derive_seed(1, 2, 3)
        True
    """
    # splitmix64-style mixing keeps nearby (layer, microbatch) pairs uncorrelated.
    x = (
        base_seed * 0x9E3779B97F4A7C15
        + layer_id * 0xBF58476D1CE4E5B9
        + microbatch_id * 0x94D049BB133111EB
    )
    x &= (1 << 64) - 1
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 29
    return x & ((1 << 63) - 1)
