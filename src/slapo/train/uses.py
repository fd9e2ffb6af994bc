"""How the main job uses each build target: :data:`TARGET_USES`, the one place in ``slapo.train``
that knows the targets by name.

Everything the loop, the layout, the memory estimate and the checkpoints need to know about a
target is a field of its :class:`TargetUse`: whether it starts ``torch.distributed``, the
options ``slapo.build`` gets, how ``--save`` keeps its state, whether it evaluates, samples,
measures a short baseline, runs pipeline stages, which target its data-parallel replicas build
on. ``--target``'s choices are the registered targets (:func:`slapo.targets.list_targets`) that
have a use here (:func:`target_choices`).

Example:
    >>> TARGET_USES["fsdp"].checkpoint
    'full'
    >>> run_target("eager", pp=1, replicas=2), run_target("fsdp", pp=2, replicas=1)
    ('ddp', 'pipeline')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..exceptions import TargetError
from .presets import CAUSAL, MODELS, causal_lm_loss

if TYPE_CHECKING:
    from .config import TrainConfig
    from .job_layout import Layout

__all__ = [
    "DEEPSPEED_ZERO_STAGE",
    "DEFAULT_TARGET",
    "PIPELINE_DATA_PARALLEL",
    "TARGET_USES",
    "TargetUse",
    "replica_engine",
    "run_target",
    "staged_target",
    "target_choices",
]


def _no_options(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    return {}


def _no_check(cfg: TrainConfig) -> None:
    return None


@dataclass(frozen=True)
class TargetUse:
    """How the main job runs on one build target, beside what the target's own record says
    (:class:`slapo.targets.TargetRecord`: whether it needs ``torch.distributed``, its
    precisions, where it keeps the model state, its memory model).

    Attributes:
        options: ``options(cfg, layout)`` -> the target's ``slapo.build`` options.
        checkpoint: how ``--save``/``--resume`` keep its state (:mod:`slapo.train.state`):
            ``"full"`` (a Hugging Face directory of the full weights and optimizer state,
            gathered from whatever holds them: tensor-parallel slices, FSDP2 shards, pipeline
            stages, ZeRO partitions, RoundPipe's optimizer copies), ``"per-rank"`` (each
            rank's own part, ``DIR.rank<r>``) or None (not wired).
        evaluates: the built model runs a forward on its own (``--eval-*``).
        samples: the trained weights are whole in the schedule's module on rank 0 (the text the
            trained model writes at the end).
        check: ``check(cfg)`` raises a :class:`~slapo.exceptions.TargetError` for options the
            target cannot run, before anything is built.
        baseline: a short unscheduled baseline can be measured beside the run (``False`` where
            the target's model is made by the schedule itself, e.g. its pipeline cuts).
        replicas: the target that data-parallel replicas of this one build on (torchrun's
            processes beyond ``--tp``); None: this one.
        stages: the target runs pipeline stages: the build target of every run with ``--pp`` 2
            or more (``--target`` then says how its replicas share gradients).
        whole_estimate: the built model is the schedule's module itself, estimated whole by
            :func:`slapo.estimate_memory` (else per rank by :func:`slapo.estimate_layout`).
        compile_model: the whole-model compilation is recommended on it (where it was measured).
        context_parallel: ``--cp`` runs on it (its replicas average gradients over dp x cp).
        expert_parallel: ``--ep`` runs on it (whole replicas: the expert weights' own hooks
            reduce their gradients, the engine averages the rest).

    Example:
        >>> TargetUse(samples=True).checkpoint
        'full'
    """

    options: Callable[[TrainConfig, Layout], dict[str, Any]] = _no_options
    checkpoint: str | None = "full"
    evaluates: bool = True
    samples: bool = False
    check: Callable[[TrainConfig], None] = _no_check
    baseline: bool = True
    replicas: str | None = None
    stages: bool = False
    whole_estimate: bool = False
    compile_model: bool = False
    context_parallel: bool = False
    expert_parallel: bool = False


def _data_parallel_options(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    # the ranks averaging gradients: dp x cp (with --tp, the mesh's other dimensions)
    return {"group": layout.grad_group if layout.grad_group is not None else layout.dp_group}


#: ``--target`` values that run with ``--pp`` 2 or more, and how the replicas of a stage then
#: share gradients (``slapo.build(..., target="pipeline", data_parallel=)``): as without
#: ``--pp``, whole replicas averaging gradients (DDP) unless ``--target fsdp`` shards them.
PIPELINE_DATA_PARALLEL = {"eager": "ddp", "pipeline": "ddp", "ddp": "ddp", "fsdp": "fsdp"}


def _check_pipeline(cfg: TrainConfig) -> None:
    if cfg.model in MODELS and cfg.model not in CAUSAL:  # (a model type: a causal LM)
        raise TargetError(
            f"--pp supports causal LMs in slapo train ({', '.join(CAUSAL)} or a transformers "
            f"causal LM type or directory), not {cfg.model}"
        )
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


#: ZeRO stage of ``slapo train --target deepspeed``: optimizer state and gradients partitioned.
DEEPSPEED_ZERO_STAGE = 2


def _deepspeed_options(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    return {
        "zero_stage": DEEPSPEED_ZERO_STAGE,
        "micro_batch_size": cfg.batch_size,
        "group": layout.dp_group,  # with --tp, the mesh's "dp" dimension: ZeRO runs over it
    }


TARGET_USES: dict[str, TargetUse] = {
    # replicas of an eager run average whole gradients: DDP
    "eager": TargetUse(
        samples=True,
        replicas="ddp",
        whole_estimate=True,
        compile_model=True,
        context_parallel=True,
        expert_parallel=True,
    ),  # fmt: skip
    # the optimizer steps RoundPipe's CPU copies of the parameters: saved by the model's names
    "roundpipe": TargetUse(),
    "ddp": TargetUse(
        options=_data_parallel_options, samples=True, context_parallel=True, expert_parallel=True
    ),
    # FSDP2's parameters and Adam state are DTensors: gathered whole, re-sharded on resume
    "fsdp": TargetUse(options=_data_parallel_options, context_parallel=True),
    "pipeline": TargetUse(
        options=_pipeline_options,
        checkpoint="full",  # each rank writes its stages' tensors into one directory
        evaluates=False,
        check=_check_pipeline,
        baseline=False,  # its stages come from the schedule's cuts
        stages=True,
        expert_parallel=True,  # with whole replicas (--target ddp)
    ),  # fmt: skip
    # ZeRO's partitioned optimizer state is gathered by parameter (DeepSpeed's own pickles)
    "deepspeed": TargetUse(options=_deepspeed_options),
}


#: The target of a run without ``--target``: the schedule's module trains as it is.
DEFAULT_TARGET = "eager"


def target_choices() -> tuple[str, ...]:
    """``--target``'s choices: the registered build targets the main job has a use for, in the
    order of :data:`TARGET_USES`.

    Example:
        >>> target_choices()[:2]
        ('eager', 'roundpipe')
    """
    from ..targets import list_targets

    registered = set(list_targets())
    return tuple(name for name in TARGET_USES if name in registered)


def staged_target() -> str:
    """The target that runs pipeline stages (``TargetUse.stages``): every ``--pp`` run builds it.

    Example:
        >>> staged_target()
        'pipeline'
    """
    return next(name for name, use in TARGET_USES.items() if use.stages)


def run_target(target: str, pp: int, replicas: int) -> str:
    """The ``slapo.build`` target of ``--target target`` with ``--pp pp`` on ``replicas``
    data-parallel replicas: the staged target with ``pp`` 2 or more; the target its replicas
    build on (``TargetUse.replicas``) with 2 replicas or more; else ``target``.

    Example:
        >>> run_target("eager", 1, 1), run_target("eager", 1, 4), run_target("ddp", 2, 2)
        ('eager', 'ddp', 'pipeline')
    """
    if pp > 1:
        return staged_target()
    use = TARGET_USES.get(target)
    if use is not None and use.replicas is not None and replicas > 1:
        return use.replicas
    return target


def replica_engine(target: str, pp: int, dp: int) -> str:
    """The engine whose memory a rank of ``--target target --pp pp`` on ``dp`` replicas holds:
    with pipeline stages and replicas, the engine the stages' replicas share gradients with
    (:data:`PIPELINE_DATA_PARALLEL`); else :func:`run_target`.

    Example:
        >>> replica_engine("fsdp", pp=2, dp=2), replica_engine("fsdp", pp=2, dp=1)
        ('fsdp', 'pipeline')
    """
    if pp > 1 and dp > 1:
        return PIPELINE_DATA_PARALLEL.get(target, target)
    return run_target(target, pp, dp)
