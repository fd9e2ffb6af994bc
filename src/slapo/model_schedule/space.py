"""Every knob of a ready schedule as a tuning symbol, for ``slapo tune``."""

from __future__ import annotations

from typing import Any

import torch

from ..tune import Space
from .knobs import CKPT_POLICIES
from .registry import family_limits

__all__ = ["tuning_space", "update_space"]


def tuning_space(space: Space, family: str, world_size: int = 1, tp_size: int = 1) -> Space:
    """Create one symbol per knob that applies to ``family`` (a registered model type, or any
    other for the generic plan); returns ``space``.

    The symbol names are ``slapo train``'s flags (``ckpt_ratio`` -> ``--ckpt-ratio``).

    Example:
        >>> space = Space()
        >>> sorted(tuning_space(space, "gpt2").to_dict())
        ['attn_op', 'ckpt_policy', 'ckpt_ratio', 'compile_blocks', 'compile_model', 'compile_rng',
         'fuse_ops', 'fused_loss']
    """
    space.create_symbol("ckpt_ratio", [0.0, 0.5, 1.0])
    space.create_symbol("ckpt_policy", list(CKPT_POLICIES))
    space.create_symbol("compile_blocks", [False, True])
    space.create_symbol("compile_model", [False, True])
    space.create_symbol("compile_rng", ["eager", "bulk"])
    space.create_symbol(
        "attn_op", ["eager", "sdpa"] + (["flash"] if torch.cuda.is_available() else [])
    )
    limits = family_limits(family)  # what the family declared it cannot do
    if "fuse_ops" not in limits:
        space.create_symbol("fuse_ops", [False, True])
    if not (family == "gpt2" and tp_size > 1):  # gpt2's TP head is vocabulary-parallel
        space.create_symbol("fused_loss", [False, True])
    if tp_size > 1 and "sequence_parallel" not in limits:
        space.create_symbol("sequence_parallel", [False, True])
    if world_size > 1:
        space.create_symbol(
            "num_stages", [n for n in range(1, world_size + 1) if world_size % n == 0]
        )
    return space


def update_space(args: Any, space: Space) -> Space:
    """``slapo tune --config`` entry point over ``slapo train`` flags (``--model``, ``--tp``).

    Example:
        slapo tune --config examples/tune_schedule.py --db db.json -- slapo train --model gpt2 --json
    """
    get = args.get if hasattr(args, "get") else lambda k, d=None: getattr(args, k, d)
    return tuning_space(space, str(get("model", "llama")), int(get("nproc", 1)), int(get("tp", 1)))
