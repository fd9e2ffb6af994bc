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
from torch.distributed.device_mesh import init_device_mesh

from .. import env
from ..exceptions import SlapoError, TargetError
from .config import TrainConfig
from .presets import CAUSAL, causal_lm_loss

__all__ = ["TARGET_USES", "Layout", "TargetUse", "setup_layout"]


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


@dataclass(frozen=True)
class TargetUse:
    """How the main job runs on one build target.

    Attributes:
        process_group: start ``torch.distributed`` even for a single process.
        data_parallel: the ranks form a (dp, tp) mesh; False: every rank is a pipeline stage.
        options: ``options(cfg, layout)`` -> the target's ``slapo.build`` options.
        checkpoints: ``--save``/``--resume`` are wired for it.
    """

    process_group: bool = False
    data_parallel: bool = True
    options: Callable[[TrainConfig, Layout], dict[str, Any]] = _no_options
    checkpoints: bool = True


TARGET_USES: dict[str, TargetUse] = {
    "eager": TargetUse(),
    "roundpipe": TargetUse(),
    "ddp": TargetUse(process_group=True, options=_data_parallel_options),
    "fsdp": TargetUse(process_group=True, options=_data_parallel_options),
    "pipeline": TargetUse(
        process_group=True, data_parallel=False, options=_pipeline_options, checkpoints=False
    ),
}


# ----- the process layout ------------------------------------------------------------------------
def setup_layout(cfg: TrainConfig) -> Layout:
    """Start the process group under torchrun and split the ranks into (dp, tp).

    Example:
        >>> setup_layout(TrainConfig(tp=2)).tp_group   # under torchrun --nproc-per-node 2
    """
    use = TARGET_USES[cfg.target]
    if not use.checkpoints and (cfg.save or cfg.resume):
        raise SlapoError(f"--save/--resume are not wired for --target {cfg.target} yet")
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
