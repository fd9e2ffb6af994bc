"""``fork_rng``: run the module under the tensor-parallel RNG state."""

from __future__ import annotations

from typing import Any

from ..random import MODEL_PARALLEL_RNG, get_cuda_rng_tracker
from ..schedule import Primitive, Schedule, register_primitive
from ..surgery import wrap_forward


@register_primitive()
class ForkRNGPrimitive(Primitive):
    """Run the module with the tracker's model-parallel RNG state (e.g. dropout in a TP region).

    Each tensor-parallel rank then draws different random numbers there, reproducibly from the seed
    given to ``slapo.set_random_seed(seed, tp_rank=...)``, which must be called before running.

    Example:
        >>> from torch import nn
        >>> import slapo
        >>> sch = slapo.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)))
        >>> sch["1"].fork_rng()
    """

    name = "fork_rng"

    @staticmethod
    def apply(sch: Schedule, name: str = MODEL_PARALLEL_RNG) -> None:
        sch.require_unapplied("fork_rng")

        def forked(forward: Any, *args: Any, **kwargs: Any) -> Any:
            with get_cuda_rng_tracker().fork(name):
                return forward(*args, **kwargs)

        wrap_forward(sch.mod, "fork_rng", forked)
