"""How the main job takes part in a run: its process layout, and how it uses each build target.

:data:`TARGET_USES` is the one place the main job knows the targets by name: which start
``torch.distributed``, how the ranks split, and which options ``slapo.build`` gets besides the
optimizer. The training loop itself (:mod:`slapo.train.loop`) names no target.

Example:
    >>> layout = setup_layout(TrainConfig())       # one process: no process group
    >>> layout.world, layout.dp_size
    (1, 1)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from .. import env
from ..exceptions import SlapoError, TargetError
from ..schedule import Schedule, create_schedule
from .config import TrainConfig
from .generic import GENERIC_KNOBS, generic_schedule
from .model_source import resolve_model
from .presets import CAUSAL, MODELS, causal_lm_loss, default_schedule

__all__ = [
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
    """The ``slapo.build`` target of a run: ``"pipeline"`` with ``--pp`` 2 or more (``--target``
    then names how its replicas share gradients); ``"ddp"`` for ``--target eager`` with
    data-parallel replicas (torchrun's processes beyond ``--tp``); else ``--target``.

    Example:
        >>> build_target(TrainConfig(pp=2, target="ddp")), build_target(TrainConfig())
        ('pipeline', 'eager')
    """
    if cfg.pp > 1:
        return "pipeline"
    replicas = int(os.environ.get("WORLD_SIZE", "1")) // cfg.tp
    return "ddp" if cfg.target == "eager" and replicas > 1 else cfg.target


# ----- the targets as the main job uses them -----------------------------------------------------
def _no_options(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    return {}


def _data_parallel_options(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    return {"group": layout.dp_group}  # with --tp, the mesh's "dp" dimension


#: ``--target`` values that run with ``--pp`` 2 or more, and how the replicas of a stage then
#: share gradients (``slapo.build(..., target="pipeline", data_parallel=)``): as without
#: ``--pp``, whole replicas averaging gradients (DDP) unless ``--target fsdp`` shards them.
PIPELINE_DATA_PARALLEL = {"eager": "ddp", "pipeline": "ddp", "ddp": "ddp", "fsdp": "fsdp"}


def _check_pipeline(cfg: TrainConfig) -> None:
    if cfg.model not in CAUSAL:
        raise TargetError(f"--pp supports {CAUSAL} in slapo train, not {cfg.model}")
    if cfg.pp < 2:
        raise TargetError("--target pipeline needs --pp 2 or more (pipeline stages)")
    if cfg.target not in PIPELINE_DATA_PARALLEL:
        raise TargetError(
            f"--pp {cfg.pp} with --target {cfg.target} is not wired in slapo train: the pipeline "
            f"replicas share gradients with --target {' or '.join(PIPELINE_DATA_PARALLEL)}"
        )


def _pipeline_options(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    _check_pipeline(cfg)
    ids = torch.zeros(cfg.batch_size, cfg.seq_len, dtype=torch.long)
    # The last stage returns logits: the loss shifts the labels as the model's own loss does.
    return {
        "schedule": cfg.pipeline_schedule, "num_microbatches": cfg.num_microbatches,
        "loss_fn": causal_lm_loss, "example_inputs": (ids,), "group": layout.mesh,
        "data_parallel": PIPELINE_DATA_PARALLEL[cfg.target],
    }  # fmt: skip


# ZeRO stage of `slapo train --target deepspeed`: optimizer state and gradients partitioned.
DEEPSPEED_ZERO_STAGE = 2


def _deepspeed_options(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    return {
        "zero_stage": DEEPSPEED_ZERO_STAGE,
        "micro_batch_size": cfg.batch_size,
        "group": layout.dp_group,  # with --tp, the mesh's "dp" dimension: ZeRO runs over it
    }


@dataclass(frozen=True)
class TargetUse:
    """How the main job runs on one build target.

    Attributes:
        process_group: start ``torch.distributed`` even for a single process.
        options: ``options(cfg, layout)`` -> the target's ``slapo.build`` options.
        checkpoint: how ``--save``/``--resume`` keep its state (:mod:`slapo.train.state`):
            ``"full"`` (a Hugging Face directory of the full weights, gathered under ``--tp``,
            written by every pipeline stage, ZeRO's optimizer partitions gathered),
            ``"per-rank"`` (each rank's own part) or None (not wired).
        evaluates: the built model runs a forward on its own (``--eval-*``).
        samples: the trained weights are whole in the schedule's module on rank 0 (the text the
            trained model writes at the end).
    """

    process_group: bool = False
    options: Callable[[TrainConfig, Layout], dict[str, Any]] = _no_options
    checkpoint: str | None = "full"
    evaluates: bool = True
    samples: bool = False


TARGET_USES: dict[str, TargetUse] = {
    "eager": TargetUse(samples=True),
    # the optimizer steps RoundPipe's copies of the parameters: saved as they are
    "roundpipe": TargetUse(checkpoint="per-rank"),
    "ddp": TargetUse(process_group=True, options=_data_parallel_options, samples=True),
    # FSDP2's parameters and Adam state are DTensors: each rank saves its part
    "fsdp": TargetUse(process_group=True, options=_data_parallel_options, checkpoint="per-rank"),
    "pipeline": TargetUse(
        process_group=True,
        options=_pipeline_options,
        checkpoint="full",  # each rank writes its stages' tensors into one directory
        evaluates=False,
    ),  # fmt: skip
    # ZeRO's partitioned optimizer state is gathered by parameter (DeepSpeed's own pickles)
    "deepspeed": TargetUse(process_group=True, options=_deepspeed_options, checkpoint="full"),
}


# ----- the process layout ------------------------------------------------------------------------
def setup_layout(cfg: TrainConfig) -> Layout:
    """Start the process group under torchrun and lay the ranks out on one mesh: ``("dp", "pp",
    "tp")`` with ``--pp`` 2 or more, else ``("dp", "tp")``; dp = processes / (tp * pp), the
    tensor-parallel ranks adjacent (as torchtitan lays them out: the busiest links innermost).

    Example:
        >>> setup_layout(TrainConfig(tp=2, pp=2)).describe()  # torchrun --nproc-per-node 8
        'dp 2 x pp 2 x tp 2 (8 processes)'
    """
    target = build_target(cfg)
    use = TARGET_USES[target]
    if use.checkpoint is None and (cfg.save or cfg.resume):
        raise SlapoError(f"--save/--resume are not wired for --target {target} yet")
    if use.checkpoint == "per-rank" and cfg.save_every:
        # each rank's final save replaces its directory whole: no step checkpoints inside
        raise SlapoError(f"--save-every is not wired for --target {target} yet (--save is)")
    if not use.evaluates and (cfg.eval_data or cfg.eval_fraction):
        raise SlapoError(f"--eval-data/--eval-fraction are not wired for --target {target}")
    if target == "pipeline":
        _check_pipeline(cfg)
    model_parallel = cfg.tp * cfg.pp
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if use.process_group or world > 1 or model_parallel > 1:
        env.setup()
        world = dist.get_world_size()
    if world % model_parallel:
        flags = " x ".join(f"--{k} {v}" for k, v in (("tp", cfg.tp), ("pp", cfg.pp)) if v > 1)
        raise SlapoError(
            f"{flags} needs a multiple of {model_parallel} processes, not {world}: "
            f"torchrun --nproc-per-node {model_parallel} (or a multiple, for data parallelism)"
        )
    if world == 1:
        return Layout()
    device = "cuda" if torch.cuda.is_available() else "cpu"
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
    if cfg.target != "eager" or cfg.tp > 1 or cfg.pp > 1:
        knobs["compile_model"] = False
    given = {
        "ckpt_ratio": cfg.ckpt_ratio, "ckpt_policy": cfg.ckpt_policy,
        "compile_blocks": cfg.compile_blocks, "compile_model": cfg.compile_model,
        "compile_rng": cfg.compile_rng, "attn_op": cfg.attn_op, "fuse_ops": cfg.fuse_ops,
        "fused_loss": cfg.fused_loss,
    }  # fmt: skip
    knobs.update({k: v for k, v in given.items() if v is not None})
    if knobs.get("attn_op") == "model":
        knobs["attn_op"] = None  # the model's own attention
    knobs.update(sequence_parallel=cfg.sequence_parallel, num_stages=cfg.pp)
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
