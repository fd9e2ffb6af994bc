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
    "schedule_family",
    "schedule_for",
    "schedule_knobs",
    "setup_layout",
]


@dataclass
class Layout:
    """How this process takes part: tensor-parallel group, data-parallel rank and size."""

    rank: int = 0
    world: int = 1
    tp_group: Any = None
    dp_group: Any = None
    dp_rank: int = 0
    dp_size: int = 1


# ----- the targets as the main job uses them -----------------------------------------------------
def _no_options(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    return {}


def _data_parallel_options(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    return {"group": layout.dp_group}  # with --tp, the mesh's "dp" dimension


def _pipeline_options(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    if cfg.model not in CAUSAL:
        raise TargetError(f"--target pipeline supports {CAUSAL} in slapo train, not {cfg.model}")
    if cfg.num_stages < 2:
        raise TargetError("--target pipeline needs --num-stages 2 or more")
    ids = torch.zeros(cfg.batch_size, cfg.seq_len, dtype=torch.long)
    # The last stage returns logits: the loss shifts the labels as the model's own loss does.
    return {
        "schedule": "1F1B", "num_microbatches": cfg.num_microbatches,
        "loss_fn": causal_lm_loss, "example_inputs": (ids,),
    }  # fmt: skip


# ZeRO stage of `slapo train --target deepspeed`: optimizer state and gradients partitioned.
DEEPSPEED_ZERO_STAGE = 2


def _deepspeed_options(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    if cfg.num_stages > 1:
        raise TargetError(
            "--target deepspeed with --num-stages is not wired in slapo train (every pipeline "
            "rank needs the same batch); slapo.build(sch, target='deepspeed', ...) runs "
            "pipeline cuts on DeepSpeed's pipeline engine"
        )
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
        data_parallel: the ranks form a (dp, tp) mesh; False: every rank is a pipeline stage.
        options: ``options(cfg, layout)`` -> the target's ``slapo.build`` options.
        checkpoint: how ``--save``/``--resume`` keep its state (:mod:`slapo.train.state`):
            ``"full"`` (a Hugging Face directory of the full weights, gathered under ``--tp``),
            ``"per-rank"`` (each rank's own part) or None (not wired).
        evaluates: the built model runs a forward on its own (``--eval-*``).
    """

    process_group: bool = False
    data_parallel: bool = True
    options: Callable[[TrainConfig, Layout], dict[str, Any]] = _no_options
    checkpoint: str | None = "full"
    evaluates: bool = True


TARGET_USES: dict[str, TargetUse] = {
    "eager": TargetUse(),
    # the optimizer steps RoundPipe's copies of the parameters: saved as they are
    "roundpipe": TargetUse(checkpoint="per-rank"),
    "ddp": TargetUse(process_group=True, options=_data_parallel_options),
    # FSDP2's parameters and Adam state are DTensors: each rank saves its part
    "fsdp": TargetUse(process_group=True, options=_data_parallel_options, checkpoint="per-rank"),
    "pipeline": TargetUse(
        process_group=True,
        data_parallel=False,
        options=_pipeline_options,
        checkpoint=None,
        evaluates=False,
    ),  # fmt: skip
    # --save/--resume: DeepSpeed's partitioned state has its own engine.save_checkpoint
    "deepspeed": TargetUse(process_group=True, options=_deepspeed_options, checkpoint=None),
}


# ----- the process layout ------------------------------------------------------------------------
def setup_layout(cfg: TrainConfig) -> Layout:
    """Start the process group under torchrun and split the ranks into (dp, tp).

    Example:
        >>> setup_layout(TrainConfig(tp=2)).tp_group   # under torchrun --nproc-per-node 2
    """
    use = TARGET_USES[cfg.target]
    if use.checkpoint is None and (cfg.save or cfg.resume):
        raise SlapoError(f"--save/--resume are not wired for --target {cfg.target} yet")
    if use.checkpoint == "per-rank" and cfg.save_every:
        # each rank's final save replaces its directory whole: no step checkpoints inside
        raise SlapoError(f"--save-every is not wired for --target {cfg.target} yet (--save is)")
    if not use.evaluates and (cfg.eval_data or cfg.eval_fraction):
        raise SlapoError(f"--eval-data/--eval-fraction are not wired for --target {cfg.target}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if use.process_group or world > 1 or cfg.tp > 1:
        env.setup()
        world = dist.get_world_size()
    if world == 1:
        if cfg.tp > 1:
            raise SlapoError(f"--tp {cfg.tp} needs {cfg.tp} processes: torchrun --nproc-per-node")
        return Layout()
    if world % cfg.tp:
        raise SlapoError(f"--tp {cfg.tp} does not divide the {world} processes")
    rank = dist.get_rank()
    if not use.data_parallel:
        if cfg.tp > 1:
            raise SlapoError(f"--target {cfg.target} with --tp is not wired in slapo train")
        return Layout(rank, world)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"] if cfg.tp > 1 else None
    dp_rank = mesh["dp"].get_local_rank()
    return Layout(rank, world, tp, mesh["dp"], dp_rank, world // cfg.tp)


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
    if cfg.target != "eager" or cfg.tp > 1 or cfg.num_stages > 1:
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
    knobs.update(sequence_parallel=cfg.sequence_parallel, num_stages=cfg.num_stages)
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
