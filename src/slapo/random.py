"""Random-number state for reproducible, parallel training.

Tensor-parallel ranks hold different slices of a layer, so dropout inside the parallel region must
draw *different* numbers on each rank, while dropout outside it must draw the *same* numbers. The
tracker keeps named generator states; ``fork()`` swaps one of them into the default generator for
the duration of a block. Activation checkpointing restores these states on recompute so a
recomputed dropout mask equals the original one.

The tracker is device-generic: it drives the CUDA generator when CUDA is available and the CPU one
otherwise, so the same code runs in CPU tests.
"""

from __future__ import annotations

import contextlib
import random as _pyrandom
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as _torch_ckpt

try:
    import numpy as np
except ImportError:  # numpy is optional: without it there is no numpy generator to seed
    np = None

from .exceptions import SlapoError

__all__ = [
    "RNGStatesTracker",
    "get_cuda_rng_tracker",
    "set_random_seed",
    "is_random_seed_set",
    "checkpoint",
    "MODEL_PARALLEL_RNG",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Offset between the data-parallel seed and the tensor-parallel seeds (any constant works; it only
# has to keep the two streams apart).
_TP_SEED_OFFSET = 2718


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that can be swapped into the default generator.

    Example:
        >>> tracker = RNGStatesTracker()
        >>> tracker.add("tp", seed=1234)
        >>> with tracker.fork("tp"):
        ...     x = torch.rand(2)
    """

    def __init__(self, device_type: str | None = None) -> None:
        self.device_type = device_type or _device_type()
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        self.states.clear()
        self.seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create the state ``name`` from ``seed`` without disturbing the default generator."""
        if seed in self.seeds:
            raise SlapoError(f"RNG seed {seed} is already used by another tracked state")
        if name in self.states:
            raise SlapoError(f"RNG state '{name}' already exists; call reset() first")
        self.seeds.add(seed)
        saved = _get_state(self.device_type)
        try:
            if self.device_type == "cuda":
                torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self.states[name] = _get_state(self.device_type)
        finally:
            _set_state(self.device_type, saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with the tracked state ``name`` as the default generator's state."""
        if name not in self.states:
            raise SlapoError(
                f"RNG state '{name}' is not set: call slapo.set_random_seed(seed, tp_rank=...) "
                "before running a module scheduled with fork_rng()"
            )
        saved = _get_state(self.device_type)
        _set_state(self.device_type, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device_type)
            _set_state(self.device_type, saved)


_TRACKER = RNGStatesTracker()
_SEED_SET = False


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process-wide RNG tracker (named for compatibility; it works on CPU too).

    Example:
        >>> tracker = get_cuda_rng_tracker()
        >>> isinstance(tracker, RNGStatesTracker)
        True
    """
    return _TRACKER


def is_random_seed_set() -> bool:
    """Whether :func:`set_random_seed` has been called in this process."""
    return _SEED_SET


def set_random_seed(
    seed: int = 2013,
    dp_rank: int | None = None,
    pp_rank: int | None = None,
    tp_rank: int | None = None,
    always_enable_tp_seed: bool = False,
) -> int:
    """Seed Python, NumPy (when present) and torch for this rank; returns the seed used.

    The default generator gets ``seed + 100 * pp_rank + 10 * dp_rank``: pipeline stages and data
    replicas draw different numbers, tensor-parallel peers the same ones. With ``tp_rank`` set, the
    tracker's model-parallel state gets ``that + 2718 + tp_rank`` for ``fork()`` blocks (dropout
    inside a tensor-parallel region). ``always_enable_tp_seed`` also seeds the default generator
    with the tensor-parallel seed, for sequence parallelism where every dropout sees a different
    slice of the sequence.

    Example:
        >>> set_random_seed(42, tp_rank=0)
        42
    """
    global _SEED_SET
    seed = int(seed) + 100 * (pp_rank or 0) + 10 * (dp_rank or 0)
    _pyrandom.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    _TRACKER.reset()
    if tp_rank is not None:
        tp_seed = seed + _TP_SEED_OFFSET + tp_rank
        _TRACKER.add(MODEL_PARALLEL_RNG, tp_seed)
        if always_enable_tp_seed:
            torch.manual_seed(tp_seed)
    _SEED_SET = True
    return seed


def _tracker_context_fn() -> tuple[contextlib.AbstractContextManager, Any]:
    """Checkpoint contexts that give the recompute the tracker states the forward had."""
    forward_states = _TRACKER.get_states()

    @contextlib.contextmanager
    def recompute_ctx() -> Iterator[None]:
        current = _TRACKER.get_states()
        _TRACKER.set_states(forward_states)
        try:
            yield
        finally:
            _TRACKER.set_states(current)

    return contextlib.nullcontext(), recompute_ctx()


def _reentrant_with_tracker(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run by torch's reentrant checkpoint with the tracker states of the forward.

    The reentrant implementation has no ``context_fn``; its first call is the forward and any
    later call the recompute in backward, which gets the states the forward started from.
    """
    forward_states = _TRACKER.get_states()
    calls = 0

    def run(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return function(*args)
        current = _TRACKER.get_states()
        _TRACKER.set_states(forward_states)
        try:
            return function(*args)
        finally:
            _TRACKER.set_states(current)

    return run


def checkpoint(
    function: Callable[..., Any], *args: Any, use_reentrant: bool = True, **kwargs: Any
) -> Any:
    """Checkpoint a model or part of it, restoring the tracker's RNG states on recompute.

    Like ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=..., **kwargs)``: the
    activations inside ``function`` are recomputed in backward instead of kept. torch restores
    the default generator's state for the recompute; this also restores the states of the tracker
    used by ``fork_rng`` (:func:`get_cuda_rng_tracker`), so a dropout inside a forked block draws
    the same mask twice.

    ``use_reentrant=True`` (the default, as in Slapo's reference API) uses torch's reentrant
    implementation, which takes positional arguments only. Where no positional tensor requires
    a gradient it would leave the parameters inside ``function`` without gradients, so that case
    runs the non-reentrant implementation instead (same results). ``use_reentrant=False`` also
    passes ``**kwargs`` to ``function``.

    Example:
        >>> layer = torch.nn.Linear(4, 4)
        >>> y = checkpoint(layer, torch.randn(2, 4, requires_grad=True))
        >>> y.sum().backward()
        >>> z = checkpoint(layer, torch.randn(2, 4), use_reentrant=False)
    """
    if use_reentrant:
        if kwargs:
            raise SlapoError(
                f"slapo.checkpoint: reentrant checkpointing cannot pass keyword arguments "
                f"{sorted(kwargs)} to the function; pass use_reentrant=False"
            )
        needs_grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        if needs_grad:
            return _torch_ckpt.checkpoint(
                _reentrant_with_tracker(function), *args, use_reentrant=True
            )
    return _torch_ckpt.checkpoint(
        function, *args, use_reentrant=False, context_fn=_tracker_context_fn, **kwargs
    )
