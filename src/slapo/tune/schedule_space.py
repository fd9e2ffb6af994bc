"""Every knob of a ready schedule, and the layout, as tuning symbols for ``slapo tune``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..model_schedule.knobs import CKPT_POLICIES
from ..model_schedule.schedule_registry import family_limits
from .launch import expert_sizes
from .space import Space

__all__ = ["layout_space", "tuning_space", "update_space"]

#: The knobs a context-parallel run keeps at their defaults: it needs the model's own attention
#: and loss, uncompiled (``slapo train --cp`` refuses them).
CONTEXT_PARALLEL_FIXED = ("attn_op", "fused_loss", "compile_blocks", "compile_model")


def layout_space(
    space: Space,
    max_procs: int,
    *,
    tp: Sequence[int] = (1, 2),
    pp: Sequence[int] = (1, 2),
    cp: Sequence[int] = (1, 2),
    num_experts: int | None = None,
) -> Space:
    """Create the layout symbols ``tp``, ``pp``, ``cp``, ``dp`` (each trial on their product of
    processes, at most ``max_procs``) and, for a model of ``num_experts`` experts per MoE layer,
    ``ep`` (:func:`slapo.tune.launch.expert_sizes`: borrowed from dp x cp); returns ``space``.
    Only the layouts ``slapo train`` runs: cp not with pipeline stages, ep not with tp.
    :func:`tuning_space` after it keeps the knobs a cp layout cannot change at their defaults.

    Example:
        >>> cfgs = list(Space(lambda args, s: layout_space(s, 4, tp=[1], pp=[1], num_experts=8)))
        >>> [(c["cp"], c["dp"], c["ep"]) for c in cfgs][-5:]      # (cp, dp, ep)
        [(2, 1, 1), (2, 1, 2), (2, 2, 1), (2, 2, 2), (2, 2, 4)]
    """
    tp_sym = space.create_symbol("tp", [t for t in tp if t <= max_procs])
    pp_sym = space.create_symbol("pp", [n for n in pp if tp_sym.value * n <= max_procs])
    used = tp_sym.value * pp_sym.value
    cp_sym = space.create_symbol(
        "cp", [c for c in cp if used * c <= max_procs and (c == 1 or pp_sym.value == 1)]
    )
    used *= cp_sym.value
    dp_sym = space.create_symbol(
        "dp", [d for d in range(1, max_procs + 1) if used * d <= max_procs]
    )
    if num_experts is not None:
        sizes = expert_sizes(dp_sym.value, cp_sym.value, num_experts)
        space.create_symbol("ep", sizes if tp_sym.value == 1 else [1])
    return space


def tuning_space(space: Space, family: str, world_size: int = 1, tp_size: int = 1) -> Space:
    """Create one symbol per knob that applies to ``family`` (a registered model type, or any
    other for the generic plan); returns ``space``.

    The symbol names are ``slapo train``'s flags (``ckpt_ratio`` -> ``--ckpt-ratio``). A ``cp``
    symbol created before (:func:`layout_space`) at a value over 1 leaves out the knobs context
    parallelism keeps at their defaults (:data:`CONTEXT_PARALLEL_FIXED`).

    Example:
        >>> space = Space()
        >>> sorted(tuning_space(space, "gpt2").to_dict())
        ['attn_op', 'ckpt_policy', 'ckpt_ratio', 'compile_blocks', 'compile_model', 'compile_rng',
         'fuse_ops', 'fused_loss']
    """
    context = "cp" in space and int(space["cp"].value or 1) > 1
    fixed = CONTEXT_PARALLEL_FIXED if context else ()

    def create(name: str, vals: list[Any]) -> None:
        if name not in fixed:
            space.create_symbol(name, vals)

    create("ckpt_ratio", [0.0, 0.5, 1.0])
    create("ckpt_policy", list(CKPT_POLICIES))
    create("compile_blocks", [False, True])
    create("compile_model", [False, True])
    create("compile_rng", ["eager", "bulk"])
    create("attn_op", ["eager", "sdpa"] + (["flash"] if torch.cuda.is_available() else []))
    limits = family_limits(family)  # what the family declared it cannot do
    if "fuse_ops" not in limits:
        create("fuse_ops", [False, True])
    if not (family == "gpt2" and tp_size > 1):  # gpt2's TP head is vocabulary-parallel
        create("fused_loss", [False, True])
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
