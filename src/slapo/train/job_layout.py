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

from .. import env
from ..exceptions import SlapoError
from ..schedule import Schedule, create_schedule
from ..sharding.mesh import check_sizes, init_parallel_mesh
from .config import TrainConfig, knob_fields
from .generic_schedule import GENERIC_KNOBS, generic_schedule
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
    """How this process takes part: its groups and coordinates on the ``("pp", "dp", "cp",
    "tp")`` mesh (torchtitan's order: the busiest links innermost; None on one process).

    ``grad_group``: the ranks whose gradients and losses are averaged, dp x cp (the cp ranks'
    losses are scaled so that their mean is the sequence's loss); ``ep_group``: the ranks that
    split each MoE layer's experts (borrowed from dp x cp); ``ep_replicas``: the ranks that hold
    the same experts.
    """

    rank: int = 0
    world: int = 1
    tp_group: Any = None
    dp_group: Any = None
    dp_rank: int = 0
    dp_size: int = 1
    mesh: Any = None
    pp_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    cp_group: Any = None
    ep_group: Any = None
    ep_replicas: Any = None
    grad_group: Any = None
    parallel_mesh: Any = None  # the slapo.sharding.ParallelMesh of them all

    def describe(self) -> str:
        """The layout in words, for the summary (cp and ep where used).

        Example:
            >>> Layout(world=8, dp_size=2, pp_size=2, tp_size=2).describe()
            'dp 2 x pp 2 x tp 2 (8 processes)'
            >>> Layout(world=8, dp_size=2, cp_size=2, tp_size=2, ep_size=4).describe()
            'dp 2 x pp 1 x cp 2 x tp 2, ep 4 (8 processes)'
        """
        shape = f"dp {self.dp_size} x pp {self.pp_size}"
        shape += f" x cp {self.cp_size}" if self.cp_size > 1 else ""
        shape += f" x tp {self.tp_size}"
        shape += f", ep {self.ep_size}" if self.ep_size > 1 else ""
        return f"{shape} ({self.world} process{'es' if self.world > 1 else ''})"

    @property
    def replicas(self) -> int:
        """How many ranks average their gradients: dp x cp."""
        return self.dp_size * self.cp_size


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
    """Start the process group under torchrun and lay the ranks out on one mesh ``("pp", "dp",
    "cp", "tp")``, torchtitan's order: dp = processes / (pp * cp * tp), the tensor-parallel
    ranks adjacent (the busiest links innermost), the pipeline stages outermost. With ``--ep``
    the experts' ranks are borrowed from dp x cp as torchtitan does: dp splits into
    (dp / (ep / cp), ep / cp) and ep = (ep / cp) x cp, so each ep group spans whole cp groups.

    Example:
        >>> # on each of 8 processes (torchrun --nproc-per-node 8): not run here
        >>> setup_layout(TrainConfig(tp=2, pp=2)).describe()  # doctest: +SKIP
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
    check_context_expert(cfg, target)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if run.record.distributed or world > 1 or cfg.tp * cfg.pp * cfg.cp > 1:
        env.setup(backend=run.backend)  # NCCL between GPUs, gloo between CPU processes
        world = dist.get_world_size()
    dp = check_sizes(world, cfg.pp, cfg.cp, cfg.tp, cfg.ep)
    if world == 1:
        return Layout()
    pm = init_parallel_mesh(run.device.type, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep)
    mesh = pm.mesh
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
        cp_size=cfg.cp,
        ep_size=cfg.ep,
        cp_group=mesh["cp"] if cfg.cp > 1 else None,
        ep_group=pm.ep,
        ep_replicas=pm.expert_replicas,
        grad_group=pm.grad,
        parallel_mesh=pm,
    )


def check_context_expert(cfg: TrainConfig, target: str) -> None:
    """Refuse the ``--cp``/``--ep`` combinations the main job does not run (before any process
    group starts), naming the flags.

    Example:
        >>> check_context_expert(TrainConfig(cp=2, pp=2), "pipeline")
        Traceback (most recent call last):
        slapo.exceptions.SlapoError: --cp 2 with --pp 2: ...
    """
    if cfg.cp > 1:
        if cfg.pp > 1:
            raise SlapoError(
                f"--cp {cfg.cp} with --pp {cfg.pp}: context parallelism inside pipeline stages "
                "is not wired yet; use --cp with --tp and data parallelism"
            )
        if not TARGET_USES[target].context_parallel:
            runs_on = [name for name, use in TARGET_USES.items() if use.context_parallel]
            raise SlapoError(
                f"--cp {cfg.cp} with --target {cfg.target}: context parallelism runs on "
                f"{' or '.join(runs_on)}"
            )
        if cfg.seq_len % (2 * cfg.cp):
            raise SlapoError(
                f"--cp {cfg.cp} splits each sequence into {2 * cfg.cp} chunks (two per rank, "
                f"load-balanced): --seq-len {cfg.seq_len} must be a multiple of {2 * cfg.cp}"
            )
        for flag, value in (
            ("--fused-loss", cfg.fused_loss),
            ("--compile-blocks", cfg.compile_blocks),
            ("--compile-model", cfg.compile_model),
        ):
            if value:
                raise SlapoError(
                    f"--cp {cfg.cp} with {flag}: context parallelism needs the model's own loss "
                    f"and attention, uncompiled; drop {flag}"
                )
        if cfg.attn_op not in (None, "model"):
            raise SlapoError(
                f"--cp {cfg.cp} with --attn-op {cfg.attn_op}: context parallelism replaces the "
                "model's own attention (transformers' attention interface); drop --attn-op"
            )
    if cfg.ep > 1:
        if cfg.tp > 1:
            raise SlapoError(
                f"--ep {cfg.ep} with --tp {cfg.tp}: tensor parallelism would shard the experts "
                "expert parallelism splits; use --ep with data, context and pipeline parallelism"
            )
        # with --pp, the stages' replicas share gradients as --target says
        replicas = PIPELINE_DATA_PARALLEL.get(cfg.target, target) if cfg.pp > 1 else target
        if not (TARGET_USES[target].expert_parallel and TARGET_USES[replicas].expert_parallel):
            runs_on = [name for name, use in TARGET_USES.items() if use.expert_parallel]
            raise SlapoError(
                f"--ep {cfg.ep} with --target {cfg.target}: expert-parallel weights differ "
                f"between the ranks; their gradients are reduced on whole replicas "
                f"({', '.join(runs_on)}), not sharded"
            )


def schedule_knobs(cfg: TrainConfig, layout: Layout | None = None) -> dict[str, Any]:
    """The ready schedule's knobs of a ``slapo train`` run: the family's recommended knobs
    (``slapo.model_schedule.recommended_knobs``, measured on CPU; the generic plan's
    :data:`~slapo.train.generic_schedule.GENERIC_KNOBS` for a model type without a ready schedule) under
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
    if not TARGET_USES[cfg.target].compile_model or max(cfg.tp, cfg.pp, cfg.cp, cfg.ep) > 1:
        knobs["compile_model"] = False
    if cfg.cp > 1:  # context parallelism runs through the model's own attention
        knobs["attn_op"] = None
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
    generic plan (:mod:`~slapo.train.generic_schedule`) for a model type without one, or none when not
    ``scheduled``.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 4)  # a model of a family with a ready schedule, in a job
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
