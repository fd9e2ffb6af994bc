"""How the main job takes part in a run: its process layout, its build target and schedule.

How the main job uses each build target is :data:`~slapo.train.uses.TARGET_USES` (re-exported
here), the one place it knows the targets by name: which start ``torch.distributed``, how the
ranks split, which options ``slapo.build`` gets besides the optimizer. Nothing else in
``slapo.train`` names a target.

Example:
    >>> layout = setup_layout(TrainConfig())       # one process: no process group
    >>> layout.world, layout.dp_size
    (1, 1)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from .. import env
from ..exceptions import SlapoError
from ..schedule import Schedule, create_schedule
from .config import TrainConfig, knob_fields
from .generic import GENERIC_KNOBS, generic_schedule
from .model_source import resolve_model
from .presets import MODELS, default_schedule
from .run import ResolvedRun, resolve_run
from .uses import (
    DEEPSPEED_ZERO_STAGE,
    PIPELINE_DATA_PARALLEL,
    TARGET_USES,
    TargetUse,
    run_target,
)

__all__ = [
    "DEEPSPEED_ZERO_STAGE",
    "PIPELINE_DATA_PARALLEL",
    "TARGET_USES",
    "Layout",
    "TargetUse",
    "build_target",
    "schedule_family",
    "schedule_for",
    "schedule_knobs",
    "setup_layout",
]


@dataclass
class Layout:
    """How this process takes part: its groups and coordinates on the ``("dp", "pp", "tp")``
    mesh (``("dp", "tp")`` without pipeline stages; None on one process)."""

    rank: int = 0
    world: int = 1
    tp_group: Any = None
    dp_group: Any = None
    dp_rank: int = 0
    dp_size: int = 1
    mesh: Any = None
    pp_size: int = 1
    tp_size: int = 1

    def describe(self) -> str:
        """The layout in words, for the summary.

        Example:
            >>> Layout(world=8, dp_size=2, pp_size=2, tp_size=2).describe()
            'dp 2 x pp 2 x tp 2 (8 processes)'
        """
        shape = f"dp {self.dp_size} x pp {self.pp_size} x tp {self.tp_size}"
        return f"{shape} ({self.world} process{'es' if self.world > 1 else ''})"


def build_target(cfg: TrainConfig) -> str:
    """The ``slapo.build`` target of a run (:func:`~slapo.train.uses.run_target`): the target
    that runs pipeline stages with ``--pp`` 2 or more (``--target`` then names how its replicas
    share gradients); the target ``--target``'s data-parallel replicas build on (torchrun's
    processes beyond ``--tp``: ``ddp`` for ``eager``); else ``--target``.

    Example:
        >>> build_target(TrainConfig(pp=2, target="ddp")), build_target(TrainConfig())
        ('pipeline', 'eager')
    """
    replicas = int(os.environ.get("WORLD_SIZE", "1")) // cfg.tp
    return run_target(cfg.target, cfg.pp, replicas)  # as resolve_run decides it


# ----- the process layout ------------------------------------------------------------------------
def setup_layout(cfg: TrainConfig, run: ResolvedRun | None = None) -> Layout:
    """Start the process group under torchrun and lay the ranks out on one mesh: ``("dp", "pp",
    "tp")`` with ``--pp`` 2 or more, else ``("dp", "tp")``; dp = processes / (tp * pp), the
    tensor-parallel ranks adjacent (as torchtitan lays them out: the busiest links innermost).

    Example:
        >>> setup_layout(TrainConfig(tp=2, pp=2)).describe()  # torchrun --nproc-per-node 8
        'dp 2 x pp 2 x tp 2 (8 processes)'
    """
    run = run or resolve_run(cfg)
    target, use = run.target, run.use
    if use.checkpoint is None and (cfg.save or cfg.resume):
        raise SlapoError(f"--save/--resume are not wired for --target {target} yet")
    if use.checkpoint == "per-rank" and cfg.save_every:
        # each rank's final save replaces its directory whole: no step checkpoints inside
        raise SlapoError(f"--save-every is not wired for --target {target} yet (--save is)")
    if not use.evaluates and (cfg.eval_data or cfg.eval_fraction):
        raise SlapoError(f"--eval-data/--eval-fraction are not wired for --target {target}")
    use.check(cfg)
    model_parallel = cfg.tp * cfg.pp
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if run.record.distributed or world > 1 or model_parallel > 1:
        env.setup(backend=run.backend)  # NCCL between GPUs, gloo between CPU processes
        world = dist.get_world_size()
    if world % model_parallel:
        flags = " x ".join(f"--{k} {v}" for k, v in (("tp", cfg.tp), ("pp", cfg.pp)) if v > 1)
        raise SlapoError(
            f"{flags} needs a multiple of {model_parallel} processes, not {world}: "
            f"torchrun --nproc-per-node {model_parallel} (or a multiple, for data parallelism)"
        )
    if world == 1:
        return Layout()
    device = run.device.type
    dp = world // model_parallel
    if cfg.pp > 1:
        shape, names = (dp, cfg.pp, cfg.tp), ("dp", "pp", "tp")
    else:
        shape, names = (dp, cfg.tp), ("dp", "tp")
    mesh = init_device_mesh(device, shape, mesh_dim_names=names)
    return Layout(
        rank=dist.get_rank(),
        world=world,
        tp_group=mesh["tp"] if cfg.tp > 1 else None,
        dp_group=mesh["dp"],
        dp_rank=mesh["dp"].get_local_rank(),
        dp_size=dp,
        mesh=mesh,
        pp_size=cfg.pp,
        tp_size=cfg.tp,
    )


def schedule_knobs(cfg: TrainConfig, layout: Layout | None = None) -> dict[str, Any]:
    """The ready schedule's knobs of a ``slapo train`` run: the family's recommended knobs
    (``slapo.model_schedule.recommended_knobs``, measured on CPU; the generic plan's
    :data:`~slapo.train.generic.GENERIC_KNOBS` for a model type without a ready schedule) under
    those ``cfg`` sets.

    The whole-model compilation is recommended on the ``eager`` target of one process without
    pipeline stages, where it was measured; the engines of the other targets run the blocks
    checkpointed selectively, uncompiled, unless ``--compile-blocks``/``--compile-model`` say so.

    Example:
        >>> schedule_knobs(TrainConfig(model="gpt2", ckpt_ratio=0.5))["ckpt_ratio"]
        0.5
    """
    from ..model_schedule import recommended_knobs  # deferred: the plans import transformers bits

    family = schedule_family(cfg.model)
    defaults = GENERIC_KNOBS if family is None else recommended_knobs(family)
    knobs = {"ckpt_ratio": 0.0, **defaults}
    if not TARGET_USES[cfg.target].compile_model or cfg.tp > 1 or cfg.pp > 1:
        knobs["compile_model"] = False
    given = {name: getattr(cfg, name) for name in knob_fields()}  # None: the recommended value
    knobs.update({k: v for k, v in given.items() if v is not None})
    if knobs.get("attn_op") == "model":
        knobs["attn_op"] = None  # the model's own attention
    knobs.update(num_stages=cfg.pp)
    if layout is not None and layout.tp_group is not None:
        knobs["group"] = layout.tp_group
    return knobs


def schedule_for(cfg: TrainConfig, model: nn.Module, layout: Layout, scheduled: bool) -> Schedule:
    """The schedule ``slapo train`` runs ``model`` with: the family's ready schedule set from
    ``cfg``'s knobs (:func:`schedule_knobs`; tensor-parallel over the layout's group), the
    generic plan (:mod:`~slapo.train.generic`) for a model type without one, or none when not
    ``scheduled``.

    Example:
        >>> sch = schedule_for(TrainConfig(), model, Layout(), scheduled=True)  # doctest: +SKIP
    """
    if not scheduled:
        return create_schedule(model)
    knobs = schedule_knobs(cfg, layout)
    if schedule_family(cfg.model) is None:
        return generic_schedule(model, **knobs)
    return default_schedule(model, knobs.pop("ckpt_ratio"), **knobs)


def schedule_family(model: str) -> str | None:
    """The ready schedule's family of ``--model`` (a family, a model type or a directory's
    ``config.model_type``); None when none is registered: the generic plan schedules it.

    Example:
        >>> schedule_family("qwen3"), schedule_family("phi3")
        ('qwen3', None)
    """
    from ..model_schedule import list_families  # deferred: the plans import transformers bits

    if model in MODELS:
        return model
    model_type = resolve_model(model).model_type
    return model_type if model_type in list_families() else None
