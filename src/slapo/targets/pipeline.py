"""The ``"pipeline"`` target: pipeline parallelism on ``torch.distributed.pipelining``.

The model is split after every ``cut_pipeline_stage`` (``slapo.pipeline.partition_model``);
each rank runs its stage(s) in a ``PipelineStage`` under a torch schedule (GPipe, 1F1B,
Interleaved1F1B, ...). Slapo adds what torch leaves to the user: user-visible names, gradient
sums of weights tied across stages, the loss on every rank, a per-stage table, and one clear
error on every rank when a stage fails.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..exceptions import TargetError
from ..logger import get_logger
from ..pipeline import TiedGradSync, find_tie_groups, format_table, partition_model, stage_table
from ..pipeline.failure import FailTogether
from ..primitives.cut_pipeline_stage import pipeline_cuts
from .common import (
    OptimizerSpec,
    default_blocks,
    default_device,
    make_optimizer,
    require_distributed,
)
from .contract import TARGET_KEY, Batch, split_batch
from .registry import register_target

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = ["PipelineEngine", "build_pipeline"]

# Schedules that hold two stages per rank in a "V": rank r runs stages r and 2P - 1 - r.
_V_SCHEDULES = {"zbvzerobubble", "dualpipev"}


class PipelineEngine:
    """This rank's part of a pipeline: its stage module(s) and the torch schedule running them.

    It honours the training-loop contract (:mod:`slapo.targets.contract`) with its own
    :meth:`train_step`; :meth:`step` takes the inputs and the target apart.

    Example:
        >>> engine, opt = slapo.build(sch, target="pipeline", schedule="1F1B",
        ...                           num_microbatches=4, loss_fn=loss, example_inputs=(ids,))
        >>> loss = slapo.train_step(engine, {"input_ids": ids, "labels": labels})
        >>> opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        schedule: Any,
        modules: dict[int, nn.Module],
        num_stages: int,
        stage_to_rank: list[int],
        group: dist.ProcessGroup | None,
        ties: TiedGradSync,
        input_shapes: list[torch.Size],
        num_microbatches: int,
        fail: FailTogether,
        input_names: tuple[str, ...] = (),
    ) -> None:
        self.schedule = schedule
        self.stage_modules = modules
        self.num_stages = num_stages
        self.stage_to_rank = stage_to_rank
        self.group = group
        self.num_microbatches = num_microbatches
        self.table: list[Any] = []
        self._ties = ties
        self._shapes = input_shapes
        self._names = input_names
        self._fail = fail
        self.is_first = 0 in modules
        self.is_last = num_stages - 1 in modules

    def step(self, *inputs: torch.Tensor, target: Any = None) -> torch.Tensor:
        """One forward and backward of the batch; returns the mean microbatch loss on every rank.

        Gradients accumulate into the stage parameters (the optimizer steps and zeroes them).
        Every rank passes the same arguments; only the first stage reads ``inputs`` and only
        the last reads ``target``.

        When a stage raises, every rank raises :class:`~slapo.pipeline.PipelineError` with that
        stage's error within a few seconds (``slapo.pipeline.failure``); the ranks' links are
        broken then, so the process groups cannot be used again in this process.
        """
        self._check_inputs(inputs)
        losses: list[torch.Tensor] = []
        with self._fail:
            args = inputs if self.is_first else ()
            kwargs = {"target": target, "losses": losses} if self.is_last else {}
            self.schedule.step(*args, **kwargs)
            self._ties()
            loss = (
                torch.stack([x.detach().float() for x in losses]).mean()
                if losses
                else (torch.zeros(()))
            )
            src = self.stage_to_rank[self.num_stages - 1]
            dist.broadcast(loss, group=self.group, group_src=src)
        return loss

    def train_step(self, batch: Batch) -> torch.Tensor:
        """One forward and backward of ``batch``, as :func:`slapo.train_step` runs it.

        A mapping batch gives the traced inputs by the forward's parameter names (e.g.
        ``input_ids``) and the target as ``labels``; a tuple is ``(inputs..., target)``. Returns
        :meth:`step`'s loss.

        Example:
            >>> loss = engine.train_step({"input_ids": ids, "labels": labels})
        """
        args, kwargs, target = split_batch(batch, with_target=True)
        named = self._names[len(args) :]
        extra = sorted(set(kwargs) - set(named))
        if extra:
            raise TargetError(
                f"pipeline: the batch has {extra}, but the stages were traced on the forward's "
                f"{list(self._names)} (example_inputs=) plus the target {TARGET_KEY!r}: drop them "
                "from the batch (constant arguments go to forward_kwargs= at build)"
            )
        inputs = (*args, *(kwargs[n] for n in named if n in kwargs))
        return self.step(*inputs, target=target)

    def _check_inputs(self, inputs: tuple) -> None:
        shapes = [tuple(x.shape) for x in inputs]
        want = [tuple(s) for s in self._shapes]
        if shapes and shapes[0] and shapes[0][0] % self.num_microbatches:
            raise TargetError(
                f"pipeline: a batch of {shapes[0][0]} does not split into "
                f"num_microbatches={self.num_microbatches} equal microbatches"
            )
        if shapes != want:
            raise TargetError(
                f"pipeline: step got inputs of shapes {shapes}, but the pipeline was traced for "
                f"{want} (example_inputs=); pass example_inputs of the training batch's shape"
            )

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the user's model."""
        seen: set[int] = set()
        for mod in self.stage_modules.values():
            for name, p in mod.named_parameters(prefix=prefix):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def train(self, mode: bool = True) -> PipelineEngine:
        for mod in self.stage_modules.values():
            mod.train(mode)
        return self

    def eval(self) -> PipelineEngine:
        return self.train(False)


@register_target("pipeline")
def build_pipeline(
    sch: Schedule,
    schedule: str = "1F1B",
    num_microbatches: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    example_inputs: Any = None,
    forward_kwargs: dict[str, Any] | None = None,
    group: Any = None,
    device: torch.device | str | None = None,
    optimizer: OptimizerSpec = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    timeout: float = 60.0,
) -> tuple[PipelineEngine, torch.optim.Optimizer | None]:
    """Split the model at its cuts and run this rank's stage(s) with a torch pipeline schedule.

    Args:
        schedule: a ``torch.distributed.pipelining`` schedule name: ``"GPipe"``, ``"1F1B"``,
            ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"``,
            ``"ZBVZeroBubble"``, ``"DualPipeV"`` (case-insensitive). Single-stage schedules need
            as many stages as pipeline ranks; the others a multiple of them.
        num_microbatches: microbatches per step; must divide the batch.
        loss_fn: ``loss_fn(last_stage_output, target_microbatch)``; the step's loss is the mean
            over microbatches and gradients are those of that mean.
        example_inputs: one training batch as passed to ``step`` (a tensor or a tuple); the
            model is traced on its first microbatch. Default: ``create_schedule(...,
            example_inputs=...)``.
        forward_kwargs: constant keyword arguments of the model's forward during tracing
            (default ``{"use_cache": False}`` when the forward takes ``use_cache``).
        group: ``None`` (all ranks form the pipeline) or a DeviceMesh: 1-D, or with a ``"pp"``
            dimension (e.g. ``("pp", "tp")`` for pipeline x tensor parallelism: schedule the
            model with ``create_schedule(model, group=mesh["tp"])`` and its tensor-parallel
            primitives before the build; each stage runs its collectives on its ``tp`` group).
        timeout: seconds a rank waits for the others' reports when a stage fails.

    Example:
        >>> sch["transformer.h.0"].cut_pipeline_stage()
        >>> engine, opt = slapo.build(sch, target="pipeline", schedule="GPipe", num_microbatches=2,
        ...     loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
        ...     example_inputs=(ids,), optimizer=torch.optim.AdamW)
        >>> loss = slapo.train_step(engine, {"input_ids": ids, "labels": ids})
        >>> opt.step(); opt.zero_grad()    # engine.step(ids, target=ids) is the same step
    """
    # deferred: torch.distributed.pipelining takes 0.4 s to import; only this target uses it
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    require_distributed("pipeline")
    cuts = pipeline_cuts(sch)
    if not cuts:
        raise TargetError(
            "pipeline: the schedule has no stage boundary; add one, e.g. "
            'sch["transformer.h.1"].cut_pipeline_stage()'
        )
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise TargetError(
            f"pipeline: num_microbatches= must be a positive int, got {num_microbatches!r}"
        )
    if loss_fn is None:
        raise TargetError("pipeline: loss_fn= is required: loss_fn(output, target) -> scalar")
    try:
        schedule_cls = get_schedule_class(schedule)
    except ValueError as exc:
        raise TargetError(f"pipeline: schedule={schedule!r}: {exc}") from exc
    single = issubclass(schedule_cls, PipelineScheduleSingle)

    inputs = _example_batch(sch, example_inputs)
    mb_args = _first_microbatch(inputs, num_microbatches)
    model = sch.mod
    kwargs = _forward_kwargs(model, forward_kwargs)
    pp_group, pp_groups = _pp_groups(group)
    pp_size = len(pp_groups[0])
    num_stages = len(cuts) + 1
    _check_stage_count(num_stages, pp_size, single, schedule)

    # Tensor-parallel gradient hooks (sync bwd_post) need a trace with autograd on.
    syncs = any(r.name == "sync" for r in sch.root.metadata.primitives)
    part = partition_model(model, cuts, mb_args, kwargs, grad=syncs)
    v_style = schedule.lower() in _V_SCHEDULES
    stage_to_rank = [_rank_of_stage(s, pp_size, num_stages, v_style) for s in range(num_stages)]
    pp_rank = dist.get_rank(pp_group) if pp_group is not None else dist.get_rank()
    dev = torch.device(device) if device is not None else default_device()
    local = {s: part.stages[s].to(dev) for s in range(num_stages) if stage_to_rank[s] == pp_rank}
    stages = [PipelineStage(mod, s, num_stages, dev, group=pp_group) for s, mod in local.items()]
    try:
        runner = schedule_cls(
            stages[0] if single else stages, n_microbatches=num_microbatches, loss_fn=loss_fn
        )
    except ValueError as exc:  # e.g. fewer microbatches than stages: name the option
        raise TargetError(
            f"pipeline: schedule={schedule!r}, num_microbatches={num_microbatches}: {exc}"
        ) from exc
    ties = find_tie_groups(model, part.stages)
    sync = TiedGradSync(ties, pp_groups, lambda s: stage_to_rank[s], local)
    stages_of_rank = _stages_of_rank(pp_groups, stage_to_rank)
    engine = PipelineEngine(
        runner,
        local,
        num_stages,
        stage_to_rank,
        pp_group,
        sync,
        [x.shape for x in inputs],
        num_microbatches,
        FailTogether(stages_of_rank, timeout),
        _positional_names(model, len(inputs)),
    )
    engine.table = stage_table(part.stages, default_blocks(sch), stage_to_rank)
    if dist.get_rank() == 0:
        tied = "; ".join(" = ".join(sorted(t.names)) + f" on stages {t.stages}" for t in ties)
        get_logger().info(
            "pipeline: %d stages, schedule %s, %d microbatches\n%s%s",
            num_stages,
            schedule_cls.__name__,
            num_microbatches,
            format_table(engine.table),
            f"\ntied across stages (gradients summed): {tied}" if tied else "",
        )
    holder = nn.ModuleList(local.values())
    return engine, make_optimizer(holder, optimizer, optimizer_kwargs)


def _example_batch(sch: Schedule, example_inputs: Any) -> tuple[torch.Tensor, ...]:
    inputs = example_inputs if example_inputs is not None else sch.extra.get("example_inputs")
    if inputs is None:
        raise TargetError(
            "pipeline: example_inputs= is required: one training batch as passed to "
            "engine.step (the stages are traced on its first microbatch)"
        )
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if not inputs or not all(isinstance(x, torch.Tensor) and x.dim() > 0 for x in inputs):
        raise TargetError(
            "pipeline: example_inputs= must be a tensor or a tuple of tensors with a batch "
            "dimension, as engine.step takes them"
        )
    return inputs


def _first_microbatch(inputs: tuple[torch.Tensor, ...], n: int) -> tuple[torch.Tensor, ...]:
    batch = inputs[0].shape[0]
    if batch % n:
        raise TargetError(
            f"pipeline: num_microbatches={n} does not divide the batch of {batch} "
            "(example_inputs=); pick a divisor"
        )
    return tuple(x[: batch // n] for x in inputs)


def _forward_kwargs(model: nn.Module, given: dict[str, Any] | None) -> dict[str, Any]:
    if given is not None:
        return dict(given)
    params = inspect.signature(model.forward).parameters
    # A key/value cache is an object graph capture cannot carry between stages.
    return {"use_cache": False} if "use_cache" in params else {}


def _positional_names(model: nn.Module, count: int) -> tuple[str, ...]:
    """The names of the forward's first ``count`` positional parameters (``input_ids``, ...)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = inspect.signature(model.forward).parameters.values()
    return tuple(p.name for p in params if p.kind in kinds)[:count]


def _pp_groups(group: Any) -> tuple[dist.ProcessGroup | None, list[list[int]]]:
    """This rank's pipeline group and the global ranks of every pipeline group."""
    if group is None:
        return None, [list(range(dist.get_world_size()))]
    if not isinstance(group, DeviceMesh):
        raise TargetError(
            f"pipeline: group= takes None or a DeviceMesh (1-D, or with a 'pp' dimension), "
            f"got {type(group).__name__}"
        )
    names = group.mesh_dim_names or ()
    if group.ndim == 1:
        return group.get_group(), [group.mesh.tolist()]
    if "pp" not in names:
        raise TargetError(
            f"pipeline: a {group.ndim}-D DeviceMesh needs a dimension named 'pp', got {names}"
        )
    dim = names.index("pp")
    ranks = group.mesh.movedim(dim, -1).reshape(-1, group.mesh.shape[dim]).tolist()
    return group["pp"].get_group(), ranks


def _check_stage_count(stages: int, ranks: int, single: bool, schedule: str) -> None:
    if single and stages != ranks:
        more = "more stages than" if stages > ranks else "fewer stages than"
        raise TargetError(
            f"pipeline: {stages} stages on {ranks} pipeline ranks ({more} ranks): schedule "
            f"{schedule!r} runs one stage per rank; cut the model into {ranks} stages, or use "
            "an interleaved schedule (e.g. 'Interleaved1F1B') with a multiple of the ranks"
        )
    if not single and stages % ranks:
        raise TargetError(
            f"pipeline: {stages} stages on {ranks} pipeline ranks: schedule {schedule!r} needs a "
            "multiple of the ranks"
        )


def _rank_of_stage(stage: int, ranks: int, stages: int, v_style: bool) -> int:
    if v_style:
        return stage if stage < ranks else stages - 1 - stage
    return stage % ranks


def _stages_of_rank(pp_groups: list[list[int]], stage_to_rank: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for ranks in pp_groups:
        for stage, pp_rank in enumerate(stage_to_rank):
            out.setdefault(ranks[pp_rank], []).append(stage)
    return out
