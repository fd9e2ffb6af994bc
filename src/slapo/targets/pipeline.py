"""The ``"pipeline"`` target: pipeline parallelism on ``torch.distributed.pipelining``.

The model is split after every ``cut_pipeline_stage`` (``slapo.pipeline.partition_model``);
each rank runs its stage(s) in a ``PipelineStage`` under a torch schedule (GPipe, 1F1B,
Interleaved1F1B, ...). Slapo adds what torch leaves to the user: user-visible names, gradient
sums of weights tied across stages, the loss on every rank, a per-stage table, and one clear
error on every rank when a stage fails.

The stages are built on the first step, from its batch (torch's pipelining infers the shapes
between stages at run time); ``example_inputs=`` builds them at build time instead.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..exceptions import TargetError
from ..logger import get_logger
from ..pipeline import TiedGradSync, find_tie_groups, format_table, partition_model, stage_table
from ..pipeline.failure import FailTogether
from ..pipeline.partition import stage_metas
from ..pipeline.replicas import FreshGrads, ReplicaGradAverage, global_grad_norm, local_part
from ..pipeline.stage_checkpoint import checkpoint_stages, checkpointed_modules
from ..precision import PRECISIONS, Precision
from ..primitives.cut_pipeline_stage import pipeline_cuts
from ..sharding.expert_grads import (
    data_parallel_params,
    expert_param_names,
    is_reduced_by_hook,
)
from .common import (
    OptimizerSpec,
    default_blocks,
    default_device,
    make_optimizer,
    require_distributed,
)
from .contract import TARGET_KEY, Batch, split_batch
from .mixed_precision import LossScaledOptimizer, autocast_forward
from .target_registry import register_target

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = ["PipelineEngine", "build_pipeline"]

#: How the data-parallel replicas of a stage share gradients (``data_parallel=``).
DATA_PARALLEL = ("ddp", "fsdp")

# Schedules that hold two stages per rank in a "V": rank r runs stages r and 2P - 1 - r.
_V_SCHEDULES = {"zbvzerobubble", "dualpipev"}


@dataclass
class _Plan:
    """What the build knows before it sees a batch: everything but the stage modules."""

    model: nn.Module
    cuts: list[str]
    forward_kwargs: dict[str, Any]
    grad: bool  # trace with autograd on (tensor-parallel bwd_post hooks)
    schedule: str
    schedule_cls: type
    single: bool
    num_microbatches: int
    loss_fn: Callable[[Any, Any], torch.Tensor]
    pp_group: dist.ProcessGroup | None
    pp_groups: list[list[int]]
    stage_to_rank: list[int]
    pp_rank: int
    device: torch.device
    blocks: list[str]
    dp_group: dist.ProcessGroup | None = None  # the replicas of this rank's stages (None: one)
    dp_mesh: DeviceMesh | None = None  # the same, as FSDP2 takes it
    data_parallel: str = "ddp"
    grad_scaler: Any = None  # scales each microbatch's loss (the step reports it unscaled)
    precision: Precision = field(default_factory=Precision)  # the stages' forwards autocast
    tp_group: dist.ProcessGroup | None = None  # the mesh's "tp" dimension (None: none)
    # the schedule's whole-module checkpoints by path (policy, None: full), re-applied in the
    # stages, and the paths checkpointed only in a traced subgraph (run unprotected)
    checkpoints: dict[str, Any] = field(default_factory=dict)
    subgraph_checkpoints: list[str] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return len(self.cuts) + 1


class PipelineEngine:
    """This rank's part of a pipeline: its stage module(s) and the torch schedule running them.

    It honours the training-loop contract (:mod:`slapo.targets.contract`) with its own
    :meth:`train_step`; :meth:`step` takes the inputs and the target apart. Built without
    ``example_inputs=``, it traces and splits the model on the first step's first microbatch
    (:attr:`built` turns True then); every later batch must have that batch's shapes.

    Example:
        >>> import slapo
        >>> import torch, transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
        ...                                  n_positions=16, bos_token_id=0, eos_token_id=0)
        >>> ids = labels = torch.randint(0, config.vocab_size, (4, 8))
        >>> sch = slapo.create_schedule(transformers.GPT2LMHeadModel(config))
        >>> sch["transformer.h.0"].cut_pipeline_stage()
        >>> def loss(logits, y):
        ...     return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        >>> # illustration: every rank of a 2-stage job (torchrun, a rank per stage); not run
        >>> engine, opt = slapo.build(sch, target="pipeline", schedule="1F1B",  # doctest: +SKIP
        ...                           num_microbatches=4, loss_fn=loss, optimizer=torch.optim.SGD)
        >>> loss = slapo.train_step(engine, {"input_ids": ids, "labels": labels})  # doctest: +SKIP
        >>> opt.step(); opt.zero_grad()  # doctest: +SKIP
    """

    def __init__(self, plan: _Plan, fail: FailTogether) -> None:
        self.schedule: Any = None  # the torch schedule, once built
        self.stage_modules: dict[int, nn.Module] = {}
        self.num_stages = plan.num_stages
        self.stage_to_rank = plan.stage_to_rank
        self.group = plan.pp_group
        self.num_microbatches = plan.num_microbatches
        self.table: list[Any] = []
        self.is_first = plan.stage_to_rank[0] == plan.pp_rank
        self.is_last = plan.stage_to_rank[-1] == plan.pp_rank
        self._plan = plan
        self.model = plan.model  # the user's whole model, as scheduled (names, tied weights)
        self._fail = fail
        self._ties: TiedGradSync | None = None
        self._shapes: list[tuple[int, ...]] = []
        self._origin = ""  # what the stages were built from, for error messages
        self._names = _positional_names(plan.model)  # cut to the traced inputs once built
        self._mode: bool | None = None  # train()/eval() asked for before the stages exist
        self._optimizers: list[torch.optim.Optimizer] = []
        self.dp_group = plan.dp_group
        self.dp_size = dist.get_world_size(plan.dp_group) if plan.dp_group is not None else 1
        self.dp_rank = dist.get_rank(plan.dp_group) if plan.dp_group is not None else 0
        self.tp_group = plan.tp_group
        self.data_parallel = plan.data_parallel if self.dp_size > 1 else None
        ddp = self.data_parallel == "ddp"
        self._average = ReplicaGradAverage(plan.dp_group) if ddp else None
        # the tensor-parallel spec of each stage parameter by name (None: replicated), read
        # before FSDP2 swaps in DTensors (checkpoints and clipping need them)
        self.shard_specs: dict[str, Any] = {}

    @property
    def built(self) -> bool:
        """Whether this rank's stages exist (after ``example_inputs=`` or the first step)."""
        return self.schedule is not None

    def build(self, *inputs: torch.Tensor, origin: str = "the first batch") -> None:
        """Trace the model on the first microbatch of ``inputs``, split it, build the stages.

        Every rank calls it with the same inputs (it creates process groups for tied weights).
        :meth:`step` calls it on its first batch; ``slapo.build(..., example_inputs=)`` at build.

        Example:
            >>> import slapo
            >>> import torch, transformers
            >>> config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
            ...                                  n_positions=16, bos_token_id=0, eos_token_id=0)
            >>> ids = labels = torch.randint(0, config.vocab_size, (4, 8))
            >>> sch = slapo.create_schedule(transformers.GPT2LMHeadModel(config))
            >>> sch["transformer.h.0"].cut_pipeline_stage()
            >>> # illustration: every rank of a 2-stage job (torchrun, a rank per stage); not run
            >>> def loss(logits, y):
            ...     return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            >>> engine, opt = slapo.build(sch, target="pipeline",  # doctest: +SKIP
            ...     schedule="GPipe", num_microbatches=2, loss_fn=loss, optimizer=torch.optim.SGD)
            >>> engine.build(ids)  # ids: one training batch, as step() takes it  # doctest: +SKIP
            >>> engine.built  # doctest: +SKIP
            True
        """
        # deferred: torch.distributed.pipelining takes 0.4 s to import; only this target uses it
        from torch.distributed.pipelining import PipelineStage

        if self.built:
            raise TargetError("pipeline: the stages are already built; build() runs once")
        p = self._plan
        inputs = _batch_tensors(inputs, origin)
        mb_args = _first_microbatch(inputs, p.num_microbatches, origin)
        part = partition_model(p.model, p.cuts, mb_args, p.forward_kwargs, grad=p.grad)
        for stage_module in part.stages:  # before the shapes: autocast sets the stages' dtypes
            autocast_forward(stage_module, p.precision)
        # Shapes known now: the stages skip torch's run-time inference (whose first-step
        # forward stage 0 kept alive). Taken before the checkpoints go in: nothing to save.
        metas = stage_metas(part.stages, mb_args)
        unprotected = checkpoint_stages(part.stages, p.checkpoints) + p.subgraph_checkpoints
        if unprotected and dist.get_rank() == 0:
            get_logger().warning(
                "pipeline: the stages run %s without activation checkpointing (the trace "
                "inlined them, or only a traced subgraph of them is checkpointed); they save "
                "all their activations for backward",
                ", ".join(f'"{u}"' for u in unprotected),
            )
        local = {
            s: part.stages[s].to(p.device)
            for s in range(p.num_stages)
            if p.stage_to_rank[s] == p.pp_rank
        }
        self.shard_specs = _specs_of(local)
        experts = [n for m in local.values() for n in expert_param_names(m)]
        if experts and self.data_parallel == "fsdp":
            raise TargetError(
                f"pipeline: data_parallel={self.data_parallel!r} would shard the expert-parallel "
                f'weights ("{experts[0]}", ...) over the replicas, which hold different experts; '
                'use data_parallel="ddp"'
            )
        if self.data_parallel == "fsdp":
            _shard_stages(local, p.dp_mesh)
        stages = [
            PipelineStage(
                mod,
                s,
                p.num_stages,
                p.device,
                input_args=metas[s][0] if metas else None,
                output_args=metas[s][1] if metas else None,
                group=p.pp_group,
            )
            for s, mod in local.items()
        ]
        try:
            runner = p.schedule_cls(
                stages[0] if p.single else stages,
                n_microbatches=p.num_microbatches,
                loss_fn=p.loss_fn,
            )
        except ValueError as exc:  # e.g. fewer microbatches than stages: name the option
            raise TargetError(
                f"pipeline: schedule={p.schedule!r}, num_microbatches={p.num_microbatches}: {exc}"
            ) from exc
        ties = find_tie_groups(p.model, part.stages)
        self._ties = TiedGradSync(ties, p.pp_groups, lambda s: p.stage_to_rank[s], local)
        self.stage_modules = local
        self.schedule = runner
        self._shapes = [tuple(x.shape) for x in inputs]
        self._origin = origin
        self._names = self._names[: len(inputs)]
        self.table = stage_table(part.stages, p.blocks, p.stage_to_rank)
        if self._mode is not None:
            self.train(self._mode)
        for opt in self._optimizers:
            _narrow_optimizer(opt, p.model, local)
        if dist.get_rank() == 0:
            tied = "; ".join(" = ".join(sorted(t.names)) + f" on stages {t.stages}" for t in ties)
            get_logger().info(
                "pipeline: %d stages, schedule %s, %d microbatches, built from %s\n%s%s",
                p.num_stages,
                p.schedule_cls.__name__,
                p.num_microbatches,
                origin,
                format_table(self.table),
                f"\ntied across stages (gradients summed): {tied}" if tied else "",
            )

    def step(self, *inputs: torch.Tensor, target: Any = None) -> torch.Tensor:
        """One forward and backward of the batch; returns the mean microbatch loss on every rank
        (with data-parallel replicas, the mean over the replicas: the global batch's loss).

        Gradients accumulate into the stage parameters (the optimizer steps and zeroes them).
        Every rank passes the same arguments; only the first stage reads ``inputs`` and only
        the last reads ``target``. The first step builds the stages when build did not.

        When a stage raises, every rank raises :class:`~slapo.pipeline.PipelineError` with that
        stage's error within a few seconds (``slapo.pipeline.failure``); the ranks' links are
        broken then, so the process groups cannot be used again in this process.
        """
        if not self.built:
            self.build(*inputs)
        self._check_inputs(inputs)
        losses: list[torch.Tensor] = []
        params = list(self.parameters())
        with self._fail, FreshGrads(params):
            args = inputs if self.is_first else ()
            kwargs = {"target": target, "losses": losses} if self.is_last else {}
            with _stage_error_unwrapped():
                self.schedule.step(*args, **kwargs)
            assert self._ties is not None  # set with the schedule
            self._ties()
            if self._average is not None:  # expert weights: their own hooks reduce them
                self._average(data_parallel_params(params))
            loss = (
                torch.stack([x.detach().float() for x in losses]).mean()
                if losses
                else (torch.zeros(()))
            )
            if self._plan.grad_scaler is not None and losses:
                loss = loss / self._plan.grad_scaler.get_scale()
            src = self.stage_to_rank[self.num_stages - 1]
            dist.broadcast(loss, group=self.group, group_src=src)
            if self.dp_group is not None:  # the global batch's loss: the replicas' mean
                dist.all_reduce(loss, group=self.dp_group)
                loss /= self.dp_size
        return loss

    def train_step(self, batch: Batch) -> torch.Tensor:
        """One forward and backward of ``batch``, as :func:`slapo.train_step` runs it.

        A mapping batch gives the traced inputs by the forward's parameter names (e.g.
        ``input_ids``), which must be its leading positional parameters, and the target as
        ``labels``; a tuple is ``(inputs..., target)``. Returns :meth:`step`'s loss.

        Example:
            >>> import slapo
            >>> import torch, transformers
            >>> config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
            ...                                  n_positions=16, bos_token_id=0, eos_token_id=0)
            >>> ids = labels = torch.randint(0, config.vocab_size, (4, 8))
            >>> sch = slapo.create_schedule(transformers.GPT2LMHeadModel(config))
            >>> sch["transformer.h.0"].cut_pipeline_stage()
            >>> # illustration: every rank of a 2-stage job (torchrun, a rank per stage); not run
            >>> def loss(logits, y):
            ...     return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            >>> engine, opt = slapo.build(sch, target="pipeline",  # doctest: +SKIP
            ...     schedule="GPipe", num_microbatches=2, loss_fn=loss, optimizer=torch.optim.SGD)
            >>> loss = engine.train_step({"input_ids": ids, "labels": labels})  # doctest: +SKIP
        """
        args, kwargs, target = split_batch(batch, with_target=True)
        named = self._names[len(args) :]
        extra = sorted(set(kwargs) - set(named))
        if extra:
            built = " (example_inputs=)" if self._origin == _EXAMPLE else ""
            raise TargetError(
                f"pipeline: the batch has {extra}, but the stages take the forward's "
                f"{list(self._names)}{built} plus the target {TARGET_KEY!r}: drop them "
                "from the batch (constant arguments go to forward_kwargs= at build)"
            )
        given = [n for n in named if n in kwargs]
        gaps = [n for n in named[: len(given)] if n not in kwargs]
        if gaps:
            raise TargetError(
                f"pipeline: the batch gives {given} but not {gaps} before them: the stages take "
                "the forward's leading positional inputs; pass a tuple batch, or drop the later "
                "inputs (constant arguments go to forward_kwargs= at build)"
            )
        inputs = (*args, *(kwargs[n] for n in given))
        return self.step(*inputs, target=target)

    def _check_inputs(self, inputs: tuple) -> None:
        shapes = [tuple(x.shape) for x in inputs]
        if shapes and shapes[0] and shapes[0][0] % self.num_microbatches:
            raise TargetError(
                f"pipeline: a batch of {shapes[0][0]} does not split into "
                f"num_microbatches={self.num_microbatches} equal microbatches"
            )
        if shapes != self._shapes:
            fix = (
                "pass example_inputs of the training batch's shape"
                if self._origin == _EXAMPLE
                else "every batch must have the first batch's shapes"
            )
            raise TargetError(
                f"pipeline: step got inputs of shapes {shapes}, but the pipeline was traced for "
                f"{self._shapes} ({self._origin}); {fix}"
            )

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the user's model.

        The stages exist once built: before the first step of a pipeline built without
        ``example_inputs=`` this raises a :class:`TargetError` (the optimizer ``build``
        returns already covers them).
        """
        if not self.built:
            raise TargetError(
                "pipeline: this rank's parameters are known once its stages are built, on the "
                "first step; pass optimizer= to slapo.build (it adopts them then), or "
                "example_inputs= (one training batch) to build the stages at build time"
            )
        seen: set[int] = set()
        for mod in self.stage_modules.values():
            for name, p in mod.named_parameters(prefix=prefix):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that the whole model's 2-norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` on one process; returns the norm before clipping.

        The norm covers every stage, every tensor-parallel slice and no weight twice: a tied
        weight counts on the first stage holding it, a replicated one on tensor rank 0; DDP's
        replicas hold equal (averaged) gradients and count once, FSDP2's each its own shard;
        expert-parallel slices count over their ep group. Call it after
        the step, before ``optimizer.step()``, on every rank.

        Example:
            >>> import slapo
            >>> import torch, transformers
            >>> config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
            ...                                  n_positions=16, bos_token_id=0, eos_token_id=0)
            >>> ids = labels = torch.randint(0, config.vocab_size, (4, 8))
            >>> sch = slapo.create_schedule(transformers.GPT2LMHeadModel(config))
            >>> sch["transformer.h.0"].cut_pipeline_stage()
            >>> batch = {"input_ids": ids, "labels": labels}
            >>> # illustration: every rank of a 2-stage job (torchrun, a rank per stage); not run
            >>> def loss(logits, y):
            ...     return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            >>> engine, opt = slapo.build(sch, target="pipeline",  # doctest: +SKIP
            ...     schedule="GPipe", num_microbatches=2, loss_fn=loss, optimizer=torch.optim.SGD)
            >>> loss = slapo.train_step(engine, batch)  # doctest: +SKIP
            >>> engine.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()  # doctest: +SKIP
        """
        if norm_type != 2.0:
            raise TargetError(f"pipeline: clip_grad_norm_ computes the 2-norm, not {norm_type}")
        first_holder = {
            n: min(t.stages) for t in (self._ties.ties if self._ties else ()) for n in t.names
        }
        tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        counted, grads, seen = [], [], set()
        experts: dict[Any, list[torch.Tensor]] = {}  # ep group -> this rank's expert slices
        for stage, mod in self.stage_modules.items():
            for name, p in mod.named_parameters(remove_duplicate=False):
                if p.grad is None or id(p) in seen:
                    continue
                seen.add(id(p))
                grad = local_part(p.grad)  # FSDP2: this replica's shard
                grads.append(grad)
                if is_reduced_by_hook(p):  # an expert slice: summed over its ep group below
                    experts.setdefault(self.shard_specs[name].group, []).append(grad)
                    continue
                if first_holder.get(name, stage) != stage:
                    continue  # a tied copy: its first stage counts it
                if self.shard_specs.get(name) is None and tp_rank != 0:
                    continue  # replicated over the tensor ranks: rank 0 counts it
                counted.append(grad)
        for group, slices in experts.items():
            # the ep ranks of this stage hold disjoint experts: their squares add up over the
            # group; one value standing for them joins this rank's counted gradients
            squares = torch.stack([g.detach().double().pow(2).sum() for g in slices]).sum()
            dist.all_reduce(squares, group=group)
            counted.append(squares.sqrt().reshape(1))
        # FSDP2's replicas hold disjoint shards (summed); DDP's hold equal copies (counted once)
        dp = self.dp_group if self.data_parallel == "fsdp" else None
        total = global_grad_norm(counted, [self.group, self.tp_group, dp])
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.device, g.dtype))
        return total.float()

    def train(self, mode: bool = True) -> PipelineEngine:
        self._mode = mode
        for mod in self.stage_modules.values():
            mod.train(mode)
        return self

    def eval(self) -> PipelineEngine:
        return self.train(False)


_EXAMPLE = "example_inputs="


@contextlib.contextmanager
def _stage_error_unwrapped() -> Iterator[None]:
    """Raise a stage's own error rather than torch's wrapper around it.

    torch wraps an error in a stage's forward in a RuntimeError listing the arguments'
    shapes (``[Stage 1] failed to run forward: ...``); the failure report names the cause.
    With the shapes given at build, the first step's forward is such a run too.
    """
    try:
        yield
    except RuntimeError as exc:
        cause = exc.__cause__
        if "failed to run forward" in str(exc) and isinstance(cause, Exception):
            raise cause from exc
        raise


def _narrow_optimizer(
    opt: torch.optim.Optimizer, model: nn.Module, local: dict[int, nn.Module]
) -> None:
    """Point an optimizer made over the whole model at this rank's stage parameters.

    Each group keeps its options (and its dict, which LR schedulers hold); its model
    parameters become the stage parameters of the same names held here. Copies the split
    made (one per stage of a tied weight) are found by name; others' parameters drop out.
    """
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    held: dict[str, nn.Parameter] = {}
    for mod in local.values():
        for name, p in mod.named_parameters(remove_duplicate=False):
            held.setdefault(name, p)
    kept: set[int] = set()
    for group in opt.param_groups:
        mine: dict[int, torch.Tensor] = {}
        for p in group["params"]:
            if id(p) not in names_of:  # not a model parameter (the factory's own): keep it
                mine.setdefault(id(p), p)
                continue
            for name in names_of[id(p)]:
                q = held.get(name)
                if q is not None and q.requires_grad:
                    mine.setdefault(id(q), q)
        group["params"] = list(mine.values())
        kept.update(mine)
    for p in [p for p in opt.state if id(p) not in kept]:
        del opt.state[p]  # no state survives for a parameter the rank no longer steps


@register_target(
    "pipeline", distributed=True, precisions=PRECISIONS, device_option=True, memory="pipeline"
)
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
    data_parallel: str = "fsdp",
    grad_scaler: Any = None,
    precision: Precision | str | torch.dtype | None = None,
) -> tuple[PipelineEngine, torch.optim.Optimizer | None]:
    """Split the model at its cuts and run this rank's stage(s) with a torch pipeline schedule.

    The stages are traced, split and built on the first ``step``/``train_step`` from its first
    microbatch (every later batch must have the first batch's shapes), or here when
    ``example_inputs`` is given.

    Args:
        schedule: a ``torch.distributed.pipelining`` schedule name: ``"GPipe"``, ``"1F1B"``,
            ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"``,
            ``"ZBVZeroBubble"``, ``"DualPipeV"`` (case-insensitive). Single-stage schedules need
            as many stages as pipeline ranks; the others a multiple of them.
        num_microbatches: microbatches per step; must divide the batch.
        loss_fn: ``loss_fn(last_stage_output, target_microbatch)``; the step's loss is the mean
            over microbatches and gradients are those of that mean.
        example_inputs: optional, one training batch as passed to ``step`` (a tensor or a
            tuple): build the stages now, traced on its first microbatch. Default:
            ``create_schedule(..., example_inputs=...)``, else the first step's batch.
        forward_kwargs: constant keyword arguments of the model's forward during tracing
            (default ``{"use_cache": False}`` when the forward takes ``use_cache``).
        group: ``None`` (all ranks form the pipeline) or a DeviceMesh: 1-D, or with a ``"pp"``
            dimension and optionally ``"dp"`` and ``"tp"`` (``("dp", "pp", "tp")`` for 3D
            parallelism, as torchtitan lays it out). With ``"tp"``, schedule the model with
            ``create_schedule(model, group=mesh["tp"])`` and its tensor-parallel primitives
            before the build; each stage runs its collectives on its ``tp`` group. With ``"dp"``,
            each data-parallel rank feeds its own slice of the global batch and the step's
            gradients are averaged over the replicas of its stage (``data_parallel=``).
        data_parallel: how replicas of a stage share gradients: ``"fsdp"`` (the default:
            FSDP2 ``fully_shard`` of each stage over ``"dp"``, parameters, gradients and
            optimizer state sharded, gathered for the step's microbatches and reduce-scattered
            after the last backward) or ``"ddp"`` (each replica holds the whole stage; the
            step's gradients are all-reduced in buckets after the schedule). Either way tied weights, the
            tensor-parallel hooks and gradient accumulation stay exact.
        grad_scaler: a loss scaler for float16 training whose checks for inf/NaN gradients
            agree over every rank (``torch.distributed.fsdp.sharded_grad_scaler.
            ShardedGradScaler``: its ``unscale_`` all-reduces them over its ``process_group``,
            default the world): each microbatch's loss is scaled before its backward and the
            step returns it unscaled; call ``scaler.step(opt)`` and ``scaler.update()`` as
            usual. Every rank then skips the same steps and keeps the same scale.
        precision: ``"bf16"``/``"fp16"``: each stage's forward runs under ``torch.autocast``
            (float32 parameters, gradients and optimizer state); fp16 also scales the loss with
            a ``ShardedGradScaler`` over every rank (unless ``grad_scaler=`` gives one) and the
            optimizer returned steps through it (``scaler.step``, ``scaler.update``).
        optimizer: an optimizer class or factory. Built here over this rank's stage parameters;
            when the stages wait for the first step, built here over the model's parameters
            and narrowed to this rank's stage parameters when the stages are built (before the
            first ``optimizer.step()``; its param-group dicts, which LR schedulers hold, stay).
        timeout: seconds a rank waits for the others' reports when a stage fails.

    Example:
        >>> import slapo
        >>> import torch, transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
        ...                                  n_positions=16, bos_token_id=0, eos_token_id=0)
        >>> ids = labels = torch.randint(0, config.vocab_size, (4, 8))
        >>> sch = slapo.create_schedule(transformers.GPT2LMHeadModel(config))
        >>> sch["transformer.h.0"].cut_pipeline_stage()
        >>> import torch.nn.functional as F
        >>> # illustration: every rank of a 2-stage job (torchrun, a rank per stage); not run
        >>> engine, opt = slapo.build(sch, target="pipeline",  # doctest: +SKIP
        ...     schedule="GPipe", num_microbatches=2,
        ...     loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
        ...     optimizer=torch.optim.AdamW)
        >>> loss = slapo.train_step(engine, {"input_ids": ids, "labels": ids})  # doctest: +SKIP
        >>> # engine.step(ids, target=ids) is the same step
        >>> opt.step(); opt.zero_grad()  # doctest: +SKIP
    """
    # deferred: torch.distributed.pipelining takes 0.4 s to import; only this target uses it
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

    inputs = example_inputs if example_inputs is not None else sch.extra.get("example_inputs")
    model = sch.mod
    pp_group, pp_groups = _pp_groups(group)
    checkpoints, subgraph_checkpoints = checkpointed_modules(sch)
    precision = Precision.of(precision)
    stage_device = torch.device(device) if device is not None else default_device()
    precision.check_device(stage_device)
    own_scaler = grad_scaler is None and precision.loss_scaling
    if own_scaler:  # fp16: every rank agrees on skipping a step that overflowed
        grad_scaler = precision.grad_scaler(stage_device.type, sharded=True)
    loss_fn = _scaled_loss(loss_fn, grad_scaler)
    if data_parallel not in DATA_PARALLEL:
        raise TargetError(
            f"pipeline: data_parallel={data_parallel!r}; use one of {DATA_PARALLEL} (how the "
            "replicas of each stage share the step's gradients)"
        )
    pp_size = len(pp_groups[0])
    num_stages = len(cuts) + 1
    _check_stage_count(num_stages, pp_size, single, schedule)
    v_style = schedule.lower() in _V_SCHEDULES
    stage_to_rank = [_rank_of_stage(s, pp_size, num_stages, v_style) for s in range(num_stages)]
    plan = _Plan(
        model=model,
        cuts=cuts,
        forward_kwargs=_forward_kwargs(model, forward_kwargs),
        # Tensor-parallel gradient hooks (sync bwd_post) need a trace with autograd on.
        grad=any(r.name == "sync" for r in sch.root.metadata.primitives),
        schedule=schedule,
        schedule_cls=schedule_cls,
        single=single,
        num_microbatches=num_microbatches,
        loss_fn=loss_fn,
        pp_group=pp_group,
        pp_groups=pp_groups,
        stage_to_rank=stage_to_rank,
        pp_rank=dist.get_rank(pp_group) if pp_group is not None else dist.get_rank(),
        device=stage_device,
        blocks=default_blocks(sch),
        dp_group=_mesh_group(group, "dp"),
        dp_mesh=group["dp"] if _mesh_group(group, "dp") is not None else None,
        data_parallel=data_parallel,
        grad_scaler=grad_scaler,
        precision=precision,
        tp_group=_mesh_group(group, "tp"),
        checkpoints=checkpoints,
        subgraph_checkpoints=subgraph_checkpoints,
    )
    engine = PipelineEngine(plan, FailTogether(_stages_of_rank(pp_groups, stage_to_rank), timeout))
    if inputs is None:
        # The stages wait for the first batch: the optimizer covers the model's parameters
        # until then, and is narrowed to this rank's stage parameters when they are built.
        opt = make_optimizer(model, optimizer, optimizer_kwargs)
        if opt is not None:
            engine._optimizers.append(opt)
        return engine, _scaled_optimizer(opt, grad_scaler if own_scaler else None)
    engine.build(
        *((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)), origin=_EXAMPLE
    )
    holder = nn.ModuleList(engine.stage_modules.values())
    opt = make_optimizer(holder, optimizer, optimizer_kwargs)
    return engine, _scaled_optimizer(opt, grad_scaler if own_scaler else None)


def _scaled_optimizer(opt: Any, scaler: Any) -> Any:
    """The optimizer stepping through the scaler ``precision=`` made (None: none made; a user's
    ``grad_scaler=`` is stepped by the user, as documented)."""
    if opt is None or scaler is None:
        return opt
    return LossScaledOptimizer(opt, scaler)


def _batch_tensors(inputs: tuple[Any, ...], origin: str) -> tuple[torch.Tensor, ...]:
    if not inputs or not all(isinstance(x, torch.Tensor) and x.dim() > 0 for x in inputs):
        raise TargetError(
            f"pipeline: {origin} must be a tensor or a tuple of tensors with a batch "
            "dimension, as engine.step takes them"
        )
    return inputs


def _first_microbatch(
    inputs: tuple[torch.Tensor, ...], n: int, origin: str
) -> tuple[torch.Tensor, ...]:
    batch = inputs[0].shape[0]
    if batch % n:
        raise TargetError(
            f"pipeline: num_microbatches={n} does not divide the batch of {batch} "
            f"({origin}); pick a divisor"
        )
    return tuple(x[: batch // n] for x in inputs)


def _forward_kwargs(model: nn.Module, given: dict[str, Any] | None) -> dict[str, Any]:
    if given is not None:
        return dict(given)
    params = inspect.signature(model.forward).parameters
    # A key/value cache is an object graph capture cannot carry between stages.
    return {"use_cache": False} if "use_cache" in params else {}


def _positional_names(model: nn.Module) -> tuple[str, ...]:
    """The names of the forward's positional parameters (``input_ids``, ...), in order."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = inspect.signature(model.forward).parameters.values()
    return tuple(p.name for p in params if p.kind in kinds)


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


def _scaled_loss(loss_fn: Callable[[Any, Any], torch.Tensor], scaler: Any) -> Callable:
    """``loss_fn`` scaled by ``scaler`` (checked to agree over the ranks), or as it is."""
    if scaler is None:
        return loss_fn
    if not hasattr(scaler, "process_group"):
        raise TargetError(
            f"pipeline: grad_scaler= is a {type(scaler).__name__}, which checks each rank's own "
            "gradients for inf/NaN: the stages would skip different steps. Pass "
            "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler(device=...), whose "
            "checks agree over its process_group (default: every rank)"
        )

    def scaled(output: Any, target: Any) -> torch.Tensor:
        return scaler.scale(loss_fn(output, target))

    # the scale exists once something was scaled: on the ranks without the loss too, whose
    # unscale_ and step need it
    scaler.scale(torch.zeros(()))
    return scaled


def _specs_of(local: dict[int, nn.Module]) -> dict[str, Any]:
    """The tensor-parallel shard spec of each stage parameter by name (None: replicated)."""
    from ..sharding import get_shard_spec  # deferred: the sharding rules load with a TP plan

    return {
        name: get_shard_spec(p)
        for mod in local.values()
        for name, p in mod.named_parameters(remove_duplicate=False)
    }


def _shard_stages(local: dict[int, nn.Module], mesh: DeviceMesh | None) -> None:
    """FSDP2 over the data-parallel replicas: each stage module one unit, sharded over ``mesh``.

    The parameters stay gathered from forward to backward (``reshard_after_forward=False``): a
    pipeline runs several microbatches' forwards before their backwards, and re-gathering for
    each would multiply the traffic. ``PipelineStage`` defers the reduce-scatter to the last
    microbatch's backward.
    """
    from torch.distributed.fsdp import fully_shard  # deferred: loads torch.distributed.tensor

    assert mesh is not None  # set with data_parallel="fsdp" on a mesh with dp > 1
    for mod in local.values():
        fully_shard(mod, mesh=mesh, reshard_after_forward=False)


def _mesh_group(group: Any, name: str) -> dist.ProcessGroup | None:
    """The process group of ``group``'s mesh dimension ``name`` (None: no such dimension)."""
    if not isinstance(group, DeviceMesh) or name not in (group.mesh_dim_names or ()):
        return None
    sub = group[name]
    return sub.get_group() if sub.size() > 1 else None


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
