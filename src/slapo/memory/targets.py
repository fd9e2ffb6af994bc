"""The memory of one rank under every build target and layout: ``dp x pp x cp x tp``, ``ep``.

:func:`slapo.estimate_memory` runs one fake step of the schedule's own module: that is one rank of
the ``eager`` target, or one tensor-parallel rank when the schedule is sharded over a (fake or
real) group. The engines of the other targets change what a rank holds, and this module models
how, from that one fake step and the module's parameter shapes (nothing is allocated):

=============  ====================================================================================
target         what one rank holds
=============  ====================================================================================
eager          the step as estimated
ddp            the same, plus DDP's gradient buckets (with ``gradient_as_bucket_view=False``, the
               default, a copy of every gradient: ``engine`` bytes). With ``pp`` > 1, the
               pipeline's DDP-style replicas (``slapo.pipeline.ReplicaGradAverage``) keep no
               buckets: after the schedule they all-reduce at most
               :data:`PIPELINE_REPLICA_BUCKET_BYTES` of gradients at once through a temporary
               buffer, a transient counted in ``live_peak`` only
fsdp           parameters, gradients and optimizer state sharded ``1/dp`` (FSDP2 pads each
               parameter's first dimension to a multiple of ``dp``), plus the parameters gathered
               at once (``engine``): the root's (kept unsharded from forward to backward) and two
               blocks' (the one running and the one prefetched in backward). With ``pp`` > 1
               each stage is one FSDP2 unit that stays gathered from its first forward to its
               last backward (``reshard_after_forward=False``): the stage's parameters, twice
               (FSDP2 keeps the flat all-gather output they were copied from until its next
               all-gather, the next step's)
deepspeed      ZeRO-1: optimizer state ``1/dp``; ZeRO-2: gradients too; ZeRO-3: parameters too.
               DeepSpeed keeps an fp32 master copy of the rank's partition (``engine``)
pipeline       the stage's parameters, gradients and optimizer state (a tied weight on two stages
               is held by both), and the activations of the microbatches in flight: GPipe keeps
               all ``num_microbatches``; 1F1B at most ``pp - stage`` (the first stage the most).
               A stage keeps the schedule's checkpoints (``slapo.pipeline.stage_checkpoint``
               re-applies them in the traced stage; :data:`PIPELINE_STAGES_CHECKPOINT`), and
               holds nothing between steps (:data:`FIRST_STAGE_HELD_MICROBATCHES`)
roundpipe      everything on the host, as eager; ``device_resident``: the bytes a device holds at
               once: one stage's parameters, buffers and gradients, plus the next stage's where
               uploads are prefetched (CUDA, or a modelled link on CPU)
=============  ====================================================================================

In mixed precision (``precision="bf16"``/``"fp16"``) every target keeps float32 master weights
and optimizer state, as its engine does (:attr:`LayoutSpec.casts_module` says which way):

=============  ====================================================================================
eager, ddp,    float32 parameters, gradients (DDP's buckets too) and state; the forward under
pipeline       autocast: 16-bit activations and weight copies (FSDP2 units of pipeline stages have
               no mixed-precision policy: their gathered parameters stay float32)
fsdp           ``MixedPrecisionPolicy(param_dtype=<16 bit>, reduce_dtype=float32)``: float32
               shards of parameters, gradients and state; parameters gathered in 16 bits, and the
               activations of a module computing with them
deepspeed      the module in 16 bits (parameters; gradients, ZeRO-2: a 16-bit partition), beside
               a float32 partition of master weights (``engine``) and its state. ZeRO-0/1 are
               modelled alike (DeepSpeed's ``BF16_Optimizer`` there is not)
roundpipe      the host's module in 16 bits (parameters, gradients), beside RoundPipe's float32
               optimizer copies (``engine``) and their state; the device holds 16-bit stages
=============  ====================================================================================

Floating-point buffers keep their dtype (DeepSpeed and RoundPipe cast them too: a few bytes).

Data parallelism composes on each stage of a pipeline (``pp`` > 1 with ``target`` ddp, fsdp or
deepspeed: the dp engine shards that stage's state), and tensor parallelism within each stage
(the schedule given is sharded over its ``tp`` group). Ranks lie on a ``("dp", "pp", "cp", "tp")``
mesh: ``rank = ((dp_rank * pp + stage) * cp + cp_rank) * tp + tp_rank``.

Context and expert parallelism change what the step itself holds, so the schedule given is
prepared for them, as for tensor parallelism (over fake groups in one process:
:func:`~slapo.memory.fake_layout_groups`), and the batch is one rank's:

=============  ====================================================================================
cp             :func:`slapo.sharding.context_parallel` over a group of ``cp`` ranks, the batch
               this rank's ``seq_len / cp`` tokens of each sequence
               (``ContextParallel.model_batch``): the step's activations are those tokens', plus
               the keys and values each attention gathers (the whole sequence) and its mask and
               scores (local queries x every key), as the fake step runs them. The data-parallel
               engine averages gradients over ``dp x cp`` ranks (its shards and buckets are
               those of ``dp * cp`` replicas); ``eager`` with cp sums them through one flat
               buffer (``all_reduce_grads``: a transient)
ep             :func:`slapo.sharding.expert_parallel` over ``ep`` ranks borrowed from dp x cp: the
               module holds ``num_experts / ep`` experts of each MoE layer, so their parameters,
               gradients and optimizer state are ``1/ep``; the tokens are routed evenly
               (:mod:`slapo.memory.stand_ins`). The experts' gradients are reduced by their
               hooks, not in DDP's buckets
=============  ====================================================================================

Example:
    >>> import slapo
    >>> import torch, transformers
    >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    ...     vocab_size=64, use_cache=False)
    >>> model = transformers.LlamaForCausalLM(config)
    >>> ids = torch.randint(0, config.vocab_size, (4, 32))
    >>> batch = {"input_ids": ids, "labels": ids}
    >>> with slapo.memory.fake_process_group(2, rank=0) as group:       # tp 2, this is tp rank 0
    ...     sch = slapo.model_schedule.apply_schedule(model, group=group)
    ...     sch["model.layers.1"].cut_pipeline_stage()
    ...     est = slapo.estimate_layout(sch, batch, target="fsdp", dp=2, pp=2, tp=2, rank=0,
    ...                                 num_microbatches=4, pipeline_schedule="1F1B")
    >>> est.stage, est.target
    (0, 'fsdp')
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..precision import Precision, PrecisionError
from .estimate import EstimateError, MemoryEstimate, estimate_memory
from .units import allocator_rounding

__all__ = [
    "ENGINE_MODELS",
    "LAYOUT_TARGETS",
    "PIPELINE_SCHEDULES",
    "LayoutSpec",
    "apply_layout",
    "estimate_layout",
    "layout_step",
    "roundpipe_resident",
]

#: The targets this module models (``pipeline`` is the pipeline engine with no dp engine).
LAYOUT_TARGETS = ("eager", "ddp", "fsdp", "deepspeed", "pipeline", "roundpipe")
#: The pipeline schedules modelled, as ``torch.distributed.pipelining`` names them.
PIPELINE_SCHEDULES = ("GPipe", "1F1B")
_DP_ENGINES = ("ddp", "fsdp", "deepspeed")
#: The most gradient bytes the pipeline's DDP-style replicas flatten into one temporary buffer
#: to all-reduce (``slapo.pipeline.replicas.BUCKET_BYTES``, DDP's default bucket size).
PIPELINE_REPLICA_BUCKET_BYTES = 25 * 2**20
#: Microbatches whose saved tensors the first stage of a pipeline keeps besides those in flight,
#: for the whole run: none since the stages get their shapes at build
#: (``slapo.pipeline.partition.stage_metas``); torch's run-time shape inference kept about one.
FIRST_STAGE_HELD_MICROBATCHES = 0
#: Whether a pipeline stage checkpoints what the schedule checkpoints: yes, the build re-applies
#: each whole-module checkpoint inside the stages (``slapo.pipeline.stage_checkpoint``).
PIPELINE_STAGES_CHECKPOINT = True


@dataclass(frozen=True)
class LayoutSpec:
    """One rank of a layout: the target (the data-parallel engine, or ``pipeline``/``roundpipe``),
    the mesh's sizes and this rank on it, and the knobs that change its memory.

    Attributes:
        target: one of :data:`LAYOUT_TARGETS`; with ``pp`` > 1, ``ddp`` or ``fsdp`` says how
            the pipeline's replicas share gradients (``slapo.build(..., target="pipeline",
            data_parallel=...)``), ``pipeline`` that there are none.
        dp, pp, tp: the mesh's sizes; ``pp`` > 1 cuts the model at its ``cut_pipeline_stage``s.
        rank: this process's global rank on the ``("dp", "pp", "tp")`` mesh.
        num_microbatches, pipeline_schedule: the pipeline's (with ``pp`` > 1).
        zero_stage: DeepSpeed's ZeRO stage (0 to 3).
        reshard_after_forward: FSDP2's (False: every block stays gathered from forward on);
            with ``pp`` > 1 each stage is one unit that stays gathered (the pipeline's build).
        devices, prefetch: RoundPipe's devices and whether it prefetches uploads.
        precision: ``"fp32"``, or mixed ``"bf16"``/``"fp16"`` as the target's engine applies it
            (see :attr:`casts_module`).

    Example:
        >>> LayoutSpec("fsdp", dp=2, pp=2, tp=2, rank=5).coords()   # (dp_rank, stage, tp_rank)
        (1, 0, 1)
        >>> LayoutSpec("fsdp", dp=8, precision="bfloat16").describe()
        'fsdp dp8 x pp1 x tp1 bf16'
    """

    target: str = "eager"
    dp: int = 1
    pp: int = 1
    tp: int = 1
    rank: int = 0
    num_microbatches: int = 1
    pipeline_schedule: str = "1F1B"
    zero_stage: int = 2
    reshard_after_forward: bool = True
    devices: int = 1
    prefetch: bool = False
    precision: str = "fp32"
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        try:  # a name, an alias or a dtype: kept as its name
            object.__setattr__(self, "precision", Precision.of(self.precision).name)
        except PrecisionError as exc:
            raise EstimateError(f"precision={self.precision!r}: {exc}") from exc
        if self.target not in LAYOUT_TARGETS:
            raise EstimateError(
                f"unknown target {self.target!r}: the memory planner models {LAYOUT_TARGETS}"
            )
        for name in ("dp", "pp", "tp", "cp", "ep", "num_microbatches", "devices"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EstimateError(f"{name} must be a positive int, got {value!r}")
        if not 0 <= self.rank < self.world:
            raise EstimateError(f"rank must lie in [0, {self.world}) for {self.describe()}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise EstimateError(
                f"pipeline_schedule must be one of {PIPELINE_SCHEDULES}, "
                f"got {self.pipeline_schedule!r}"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise EstimateError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.target in ("eager", "roundpipe", "pipeline") and self.dp > 1:
            raise EstimateError(
                f"target {self.target} has no data-parallel engine: with dp {self.dp} name one "
                f"(target= {', '.join(_DP_ENGINES)})"
            )
        if self.target == "roundpipe" and max(self.pp, self.tp, self.cp, self.ep) > 1:
            raise EstimateError("target roundpipe runs in one process: pp, tp, cp and ep must be 1")
        if self.ep > 1 and (self.ep % self.cp or self.replicas % self.ep):
            raise EstimateError(
                f"ep {self.ep} borrows its ranks from dp x cp = {self.dp} x {self.cp}: it must "
                f"divide {self.replicas} and be a multiple of cp {self.cp}"
            )

    @property
    def world(self) -> int:
        """The number of processes: ``dp * pp * cp * tp``."""
        return self.dp * self.pp * self.cp * self.tp

    @property
    def replicas(self) -> int:
        """The ranks a stage's data-parallel engine averages gradients over: ``dp * cp`` (the
        ranks of a cp group hold the same weights, each the gradient of its tokens).

        Example:
            >>> LayoutSpec("fsdp", dp=2, cp=2).replicas
            4
        """
        return self.dp * self.cp

    def sizes(self) -> dict[str, int]:
        """The layout's sizes as the estimate reports them: ``dp``, ``pp``, ``tp``, and ``cp``
        and ``ep`` where over 1.

        Example:
            >>> LayoutSpec("ddp", dp=2, cp=2, ep=4).sizes()
            {'dp': 2, 'pp': 1, 'tp': 1, 'cp': 2, 'ep': 4}
        """
        sizes = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        sizes.update({k: v for k, v in (("cp", self.cp), ("ep", self.ep)) if v > 1})
        return sizes

    @property
    def casts_module(self) -> bool:
        """Whether the engine computes with the module's parameters cast to the compute dtype
        (FSDP2's MixedPrecisionPolicy, DeepSpeed's and RoundPipe's cast module) rather than
        under autocast (eager, DDP and the pipeline's stages, whose FSDP2 units have no policy).

        Example:
            >>> LayoutSpec("fsdp", dp=2, precision="bf16").casts_module
            True
            >>> LayoutSpec("ddp", dp=2, precision="bf16").casts_module
            False
        """
        if self.precision == "fp32":
            return False
        return self.target in ("deepspeed", "roundpipe") or (self.target == "fsdp" and self.pp == 1)

    def coords(self) -> tuple[int, int, int]:
        """``(dp_rank, stage, tp_rank)`` of :attr:`rank` on the ``("dp", "pp", "cp", "tp")``
        mesh (its cp rank: :attr:`cp_rank`)."""
        tp_rank = self.rank % self.tp
        stage = (self.rank // (self.tp * self.cp)) % self.pp
        return self.rank // (self.tp * self.cp * self.pp), stage, tp_rank

    @property
    def cp_rank(self) -> int:
        """The context-parallel rank of :attr:`rank`."""
        return (self.rank // self.tp) % self.cp

    def describe(self) -> str:
        """The layout in words, e.g. ``fsdp dp2 x pp2 x tp2 (1F1B, 4 microbatches)``, with cp
        and ep where over 1 (``ddp dp2 x pp1 x cp2 x tp1 ep4``)."""
        text = f"{self.target} dp{self.dp} x pp{self.pp}"
        text += f" x cp{self.cp}" if self.cp > 1 else ""
        text += f" x tp{self.tp}" + (f" ep{self.ep}" if self.ep > 1 else "")
        if self.pp > 1:
            text += f" ({self.pipeline_schedule}, {self.num_microbatches} microbatches)"
        if self.target == "deepspeed":
            text += f" ZeRO-{self.zero_stage}"
        return text if self.precision == "fp32" else f"{text} {self.precision}"


# ----- what a module holds, by stage -------------------------------------------------------------
def _local_nbytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``t`` on this rank (a DTensor's local shard, a meta tensor's would-be size) in
    ``dtype`` (None: its own)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * (local.element_size() if dtype is None else dtype.itemsize)


def _stage_assigner(model: nn.Module, cuts: Iterable[str]) -> Callable[[str], int]:
    """``stage(path)`` of a module path: the number of cuts whose subtree ends before it, in the
    module tree's pre-order (the forward order of a model that registers its modules in the order
    it runs them, as transformers models do). A module above a cut (the root, ``transformer``)
    spans stages: what it does itself (the loss, of a causal LM) is counted on the last stage."""
    order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    ends = []
    for cut in cuts:
        if cut not in order:
            raise EstimateError(f"pipeline cut {cut!r} is no submodule of {type(model).__name__}")
        subtree = [i for p, i in order.items() if p == cut or p.startswith(cut + ".")]
        ends.append(max(subtree))
    ends.sort()
    last = len(ends)
    cut_set = set(cuts)

    def stage(path: str) -> int:
        above = path not in cut_set and any(not path or c.startswith(path + ".") for c in cut_set)
        index = order.get(path)
        if above or index is None:
            return last
        return sum(1 for end in ends if index > end)

    return stage


def _params_by_stage(
    model: nn.Module, stage_of: Callable[[str], int], stages: int
) -> list[dict[int, torch.Tensor]]:
    """Per stage, its parameters by id: a weight tied across stages is in each that uses it."""
    out: list[dict[int, torch.Tensor]] = [{} for _ in range(stages)]
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = name.rpartition(".")[0]
        out[stage_of(owner)][id(p)] = p
    return out


def _blocks(model: nn.Module) -> list[str]:
    """The paths of the blocks of every layer list (FSDP's units, as the fsdp target wraps)."""
    blocks: list[str] = []
    for path, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList):
            for name, _ in mod.named_children():
                child = f"{path}.{name}" if path else name
                if not any(child.startswith(b + ".") for b in blocks):
                    blocks.append(child)
    return blocks


def _fsdp_shard(p: torch.Tensor, dp: int, dtype: torch.dtype | None = None) -> int:
    """The bytes of one FSDP2 shard of ``p`` in ``dtype`` (None: its own): its first dimension
    padded to a multiple of dp."""
    local = p.to_local() if hasattr(p, "to_local") else p
    size = local.element_size() if dtype is None else dtype.itemsize
    if local.dim() == 0:
        return size
    rows = math.ceil(local.shape[0] / dp)
    return rows * (local.numel() // max(local.shape[0], 1)) * size


# ----- the models --------------------------------------------------------------------------------
def roundpipe_resident(passes: list[list[int]], devices: int = 1, prefetch: bool = False) -> int:
    """The most bytes one RoundPipe device holds at once, as its memory account counts them.

    ``passes`` are the uploads of each pass (the forward, whose last stage runs fused with its
    backward, then the backward) in the order RoundPipe launches them: each stage's parameters,
    buffers and room for its gradients. Jobs go to the devices round-robin. A device holds its
    running stage, and with ``prefetch`` also its next job of the same pass (a pass's jobs are
    queued when it launches; the backward's only after the forward ends).

    Example:
        >>> roundpipe_resident([[10, 30, 20], [30, 10]])
        30
        >>> roundpipe_resident([[10, 30, 20], [30, 10]], prefetch=True)
        50
    """
    peak, job = 0, 0
    for jobs in passes:
        on_device: dict[int, list[int]] = {}
        for nbytes in jobs:
            on_device.setdefault(job % devices, []).append(nbytes)
            job += 1
        for mine in on_device.values():
            for i, nbytes in enumerate(mine):
                ahead = mine[i + 1] if prefetch and i + 1 < len(mine) else 0
                peak = max(peak, nbytes + ahead)
    return peak


@dataclass
class _Held:
    """What one rank holds, tensor by tensor (bytes), as its engine transforms it: parameters
    and gradients as the module holds them, the float32 (fp32 run: the parameters' own dtype)
    bytes the optimizer steps (``masters``: its state is proportional), the engine's parts."""

    params: list[int]
    grads: list[int]
    masters: list[int]
    parts: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    transient: int = 0  # bytes a step allocates after its schedule ran (activations freed)


@dataclass(frozen=True)
class _Rank:
    """One rank of a layout as the engine models read it: its spec, the module, this stage's
    parameters by name, the stage of a module path, the dtypes of the master weights and of
    the module's computing weights, whether the engine casts the module."""

    spec: LayoutSpec
    module: nn.Module
    mine: dict[str, torch.Tensor]
    stage_of: Callable[[str], int]
    stage: int
    master: torch.dtype | None
    module_dtype: torch.dtype | None
    cast: bool

    def in_stage(self, block: str) -> bool:
        return self.spec.pp == 1 or self.stage_of(block) == self.stage


def _as_is(held: _Held, rank: _Rank) -> None:
    """eager and a pipeline without replicas: the rank holds what the step estimated; with cp,
    ``all_reduce_grads`` sums the gradients over the cp group through one flat buffer."""
    if rank.spec.cp > 1:
        held.transient = max(held.transient, sum(held.grads) - _hooked_grads(rank))


def _hooked_grads(rank: _Rank) -> int:
    """The gradient bytes of the expert-parallel weights whose own hooks reduce them
    (``slapo.sharding.reduce_expert_grads``): data-parallel engines leave them out."""
    from ..sharding.expert_grads import is_reduced_by_hook

    return sum(
        _local_nbytes(p, rank.module_dtype) for p in rank.mine.values()
        if p.requires_grad and is_reduced_by_hook(p)
    )  # fmt: skip


def _ddp_model(held: _Held, rank: _Rank) -> None:
    if rank.spec.replicas > 1:
        _ddp(held, rank.spec, _hooked_grads(rank))


def _fsdp_model(held: _Held, rank: _Rank) -> None:
    if rank.spec.replicas > 1 or rank.cast:
        _fsdp(held, rank.spec, rank.module, rank.mine, rank.in_stage, rank.master,
              rank.module_dtype)  # fmt: skip


def _deepspeed_model(held: _Held, rank: _Rank) -> None:
    if rank.spec.replicas > 1 or rank.cast:
        _deepspeed(held, rank.spec, rank.cast)


def _roundpipe_model(held: _Held, rank: _Rank) -> None:
    # RoundPipe's optimizer copies, which the optimizer steps: float32 (the master weights of
    # a bf16 model), and in a float32 run a copy of every trainable parameter all the same
    held.parts["roundpipe fp32 optimizer copies"] = list(held.masters)


def _ddp(held: _Held, spec: LayoutSpec, hooked: int = 0) -> None:
    """DDP's buckets of the gradients it averages: all but the ``hooked`` bytes (expert weights
    whose own hooks reduce their gradients)."""
    if spec.pp > 1:  # the pipeline's replicas: no buckets kept, a flat buffer per all-reduce
        held.transient = min(sum(held.grads) - hooked, PIPELINE_REPLICA_BUCKET_BYTES)
        return
    total, cap = sum(held.grads) - hooked, PIPELINE_REPLICA_BUCKET_BYTES  # DDP's bucket_cap_mb
    held.parts["ddp gradient buckets"] = [min(cap, total - i) for i in range(0, total, cap)]


def _fsdp(
    held: _Held,
    spec: LayoutSpec,
    module: nn.Module,
    mine: dict[int, torch.Tensor],
    in_stage: Callable[[str], bool],
    shard_dtype: torch.dtype | None,
    gather_dtype: torch.dtype | None,
) -> None:
    """FSDP2: parameters, gradients (and so the optimizer state) in ``1/(dp * cp)`` shards of
    ``shard_dtype``; parameters gathered in ``gather_dtype`` (a MixedPrecisionPolicy's)."""
    shard = {i: _fsdp_shard(p, spec.replicas, shard_dtype) for i, p in mine.items()}
    held.params = list(shard.values())
    held.grads = [shard[i] for i, p in mine.items() if p.requires_grad]
    held.masters = list(held.grads)
    if spec.pp > 1:
        # each stage one FSDP2 unit, gathered from its first forward to its last backward: the
        # unsharded parameters (padding included) and the flat all-gather output they were
        # copied out of, which FSDP2 keeps (``all_gather_state``) until its next all-gather:
        # with one unit per stage, the next step's
        unsharded = [n * spec.replicas for n in held.params]
        held.parts["fsdp gathered parameters"] = [*unsharded, sum(unsharded)]
        return
    in_blocks: dict[str, list[int]] = {}
    for block in _blocks(module):
        if in_stage(block):
            owned = {id(p): p for p in module.get_submodule(block).parameters()}
            in_blocks[block] = [
                _local_nbytes(p, gather_dtype) for i, p in owned.items() if i in mine
            ]
    block_ids = {id(p) for b in in_blocks for p in module.get_submodule(b).parameters()}
    root = [_local_nbytes(p, gather_dtype) for i, p in mine.items() if i not in block_ids]
    ranked = sorted(in_blocks.values(), key=sum, reverse=True)
    # the root's (kept from forward to backward) and two blocks' (the one running and the one
    # prefetched in backward), or every block's when none reshards after forward
    gathered = ranked[:2] if spec.reshard_after_forward else ranked
    held.parts["fsdp gathered parameters"] = [n for sizes in [root, *gathered] for n in sizes]


def _deepspeed(held: _Held, spec: LayoutSpec, cast: bool) -> None:
    """ZeRO-1/2/3: the optimizer steps this rank's float32 partition (and ZeRO-2 reduces the
    gradients into a partition, ZeRO-3 partitions the parameters too)."""
    part = math.ceil(sum(held.masters) / spec.replicas)
    held.masters = [part]
    if spec.zero_stage >= 2:
        held.grads = [math.ceil(sum(held.grads) / spec.replicas)]
    if spec.zero_stage >= 3:
        held.params = [math.ceil(sum(held.params) / spec.replicas)]
    if spec.zero_stage >= 1 or cast:
        held.parts["deepspeed fp32 partition"] = [part]


def _state_tensors(masters: list[int], ratio: float) -> list[int]:
    """The optimizer state of the tensors of ``masters`` bytes at ``ratio`` bytes per byte, as
    tensors (AdamW: two the size of each, its step counts left out)."""
    count = max(round(ratio), 1)
    return [round(n * ratio / count) for n in masters for _ in range(count)] if ratio else []


def _stage_activations(
    base: MemoryEstimate, spec: LayoutSpec, stage_of: Callable[[str], int], stage: int
) -> dict[str, int]:
    """The activations of a pipeline stage by module: its microbatches in flight."""
    by_module = {k: n for k, n in base.by_module.items() if stage_of(k) == stage}
    in_flight = spec.num_microbatches
    if spec.pipeline_schedule == "1F1B":
        in_flight = min(spec.num_microbatches, spec.pp - stage)
    if stage == 0:
        in_flight += FIRST_STAGE_HELD_MICROBATCHES
    return {k: n * in_flight for k, n in by_module.items()}


#: How each engine changes what a rank holds, by the name a target's record gives as its memory
#: model (:attr:`slapo.targets.TargetRecord.memory`); :data:`LAYOUT_TARGETS` are its keys.
ENGINE_MODELS: dict[str, Callable[[_Held, _Rank], None]] = {
    "eager": _as_is, "ddp": _ddp_model, "fsdp": _fsdp_model, "deepspeed": _deepspeed_model,
    "pipeline": _as_is, "roundpipe": _roundpipe_model,
}  # fmt: skip


def apply_layout(
    base: MemoryEstimate, model: Any, spec: LayoutSpec, cuts: list[str] | None = None
) -> MemoryEstimate:
    """What one rank of ``spec`` holds, from ``base``: :func:`slapo.estimate_memory` of
    ``model`` (the schedule's module, sharded over its tp group) on one data-parallel rank's
    batch, or on one microbatch of it when ``spec.pp > 1``, in ``spec.precision`` (with
    ``cast_params=spec.casts_module``). ``cuts``: the pipeline's cuts (module paths), where
    ``model`` is not the schedule that holds them.

    Example:
        >>> import slapo
        >>> import torch, transformers
        >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        ...     vocab_size=64, use_cache=False)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> ids = torch.randint(0, config.vocab_size, (4, 32))
        >>> batch = {"input_ids": ids, "labels": ids}
        >>> sch = slapo.create_schedule(model)
        >>> base = slapo.estimate_memory(sch, batch)
        >>> apply_layout(base, sch.mod, LayoutSpec("ddp", dp=2)).engine == base.grads
        True
    """
    from ..primitives.cut_pipeline_stage import pipeline_cuts
    from ..schedule import Schedule

    if base.precision != spec.precision:
        raise EstimateError(
            f"apply_layout: the base estimate is in {base.precision}, the layout in "
            f"{spec.precision}; estimate the step with precision={spec.precision!r}"
        )
    if cuts is None:
        cuts = pipeline_cuts(model) if isinstance(model, Schedule) else []
    module = model.mod if isinstance(model, Schedule) else model
    _check_prepared(module, spec)
    _, stage, _ = spec.coords()
    stages = 1
    if spec.pp > 1 or spec.target == "roundpipe":
        stages = len(cuts) + 1
        if spec.pp > 1 and stages != spec.pp:
            raise EstimateError(
                f"pp {spec.pp} needs {spec.pp - 1} cut_pipeline_stage cut(s) in the schedule; "
                f"it has {len(cuts)}"
            )
    stage_of = _stage_assigner(module, cuts if stages > 1 else [])
    by_stage = _params_by_stage(module, stage_of, stages)
    all_params = {k: v for group in by_stage for k, v in group.items()}
    precision = Precision.of(spec.precision)
    cast = spec.casts_module
    master = torch.float32 if precision.mixed else None  # None: the parameters' own dtype
    module_dtype = precision.compute_dtype if cast else master
    trainable_total = sum(_local_nbytes(p, master) for p in all_params.values() if p.requires_grad)
    # optimizer state per trainable byte (AdamW: 2 and a step count per parameter)
    state_ratio = base.optimizer_state / trainable_total if trainable_total else 0.0

    mine = by_stage[stage] if spec.pp > 1 else all_params
    trainable = [p for p in mine.values() if p.requires_grad]
    held = _Held(
        params=[_local_nbytes(p, module_dtype) for p in mine.values()],
        grads=[_local_nbytes(p, module_dtype) for p in trainable],
        masters=[_local_nbytes(p, master) for p in trainable],
    )
    buffers, activations, by_module = base.buffers, base.activations, dict(base.by_module)
    if spec.pp > 1:
        by_module = _stage_activations(base, spec, stage_of, stage)
        activations = sum(by_module.values())
        buffer_owners = {
            id(b): stage_of(n.rpartition(".")[0]) for n, b in module.named_buffers()
        }  # fmt: skip
        buffers = sum(
            _local_nbytes(b) for b in module.buffers() if buffer_owners.get(id(b), stage) == stage
        )

    target = spec.target
    rank = _Rank(spec, module, mine, stage_of, stage, master, module_dtype, cast)
    ENGINE_MODELS[target](held, rank)
    resident = None
    if target == "roundpipe":
        uploads = []
        for group in by_stage:
            nbytes = sum(_local_nbytes(p, module_dtype) for p in group.values())
            nbytes += sum(_local_nbytes(p, module_dtype) for p in group.values() if p.requires_grad)
            uploads.append(nbytes)
        # the stages run forward in order (the last one fused with its backward), then the
        # backward pass the others in reverse
        passes = [uploads, uploads[-2::-1]]
        resident = roundpipe_resident(passes, spec.devices, spec.prefetch) + base.buffers
    params, grads = sum(held.params), sum(held.grads)
    state = round(sum(held.masters) * state_ratio)
    parts = {name: sum(sizes) for name, sizes in held.parts.items()}
    engine = sum(parts.values())
    # the step's own temporaries at its forward and at its backward peak, then this rank's
    # parts at that moment: gradients only those alive then (none in the forward; a backward
    # peak at the loss holds none either: subtracting all of them would drop a large model's
    # loss temporaries), all of them where microbatches accumulate into them (a pipeline).
    # The optimizer's step is the engine's (its peak: the parts, below).
    accumulate = spec.pp > 1
    base_grads = base.grads if base.grads_at_peak is None else base.grads_at_peak
    grads_alive = grads * base_grads / base.grads if base.grads and not accumulate else grads
    held_parts = params + state + activations + engine
    fixed = base.params + base.optimizer_state + base.activations + base.engine
    live = max(base.live_peak if base.backward_peak is None else base.backward_peak, 0)
    live = max(live - fixed - base_grads, 0) + held_parts + round(grads_alive)
    if base.forward_peak is not None:
        forward = max(base.forward_peak - fixed, 0) + held_parts
        live = max(live, forward + (grads if accumulate else 0))
    if base.backward_other_peak is not None and base.grads_at_other_peak is not None:
        then = grads * base.grads_at_other_peak / base.grads if base.grads else 0
        other = max(base.backward_other_peak - fixed - base.grads_at_other_peak, 0)
        live = max(live, other + held_parts + (grads if accumulate else round(then)))
    if spec.pp > 1 and base.peak_temporaries:
        # a stage holds the temporaries its own modules made (the last one the loss's)
        own = [
            sum(n for path, n in at_peak.items() if stage_of(path) == stage)
            for at_peak in base.peak_temporaries.values()
        ]  # fmt: skip
        live = held_parts + grads + max(own)
    live = max(live, params + buffers + grads + state + engine + held.transient)
    scale = activations / base.activations if base.activations else 0.0
    rounding = {
        "params": allocator_rounding(held.params),
        "buffers": base.rounding.get("buffers", 0),
        "grads": allocator_rounding(held.grads),
        "optimizer_state": allocator_rounding(_state_tensors(held.masters, state_ratio)),
        "activations": round(base.rounding.get("activations", 0) * scale),
        **{name: allocator_rounding(sizes) for name, sizes in held.parts.items()},
    }  # fmt: skip
    return dataclasses.replace(
        base,
        params=params,
        buffers=buffers,
        grads=grads,
        optimizer_state=state,
        activations=activations,
        live_peak=live,
        forward_peak=None,  # live_peak is the layout's
        backward_peak=None,
        grads_at_peak=None if base.grads_at_peak is None else round(grads_alive),
        backward_other_peak=None,
        grads_at_other_peak=None,
        peak_temporaries={},  # the layout's live_peak holds them
        by_module=by_module,
        engine=engine,
        engine_parts=parts,
        device_resident=resident,
        target=target,
        layout=spec.sizes(),
        stage=stage if spec.pp > 1 else None,
        rank=spec.rank if spec.world > 1 else base.rank,
        world_size=spec.world if spec.world > 1 else base.world_size,
        weight_copies=round(base.weight_copies * scale),
        rounding=rounding,
    )


def _check_prepared(module: nn.Module, spec: LayoutSpec) -> None:
    """Raise unless ``module`` runs the context and expert parallelism of ``spec`` (its attention
    over a cp group; each MoE layer holding ``1/ep`` of its experts): the fake step estimates
    the module as it is."""
    from ..sharding.context_attention import CP_ATTENTION
    from ..sharding.expert_parallel import ExpertParallelExperts

    how = "(in one process: slapo.memory.fake_layout_groups(cp=..., ep=...))"
    attention = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if spec.cp > 1 and attention != CP_ATTENTION:
        raise EstimateError(
            f"cp {spec.cp}: {type(module).__name__} runs attention {attention!r}; estimate the "
            "schedule as a cp rank runs it: slapo.sharding.context_parallel(model, group) over "
            f"a group of cp ranks {how}, on that rank's batch (ContextParallel.model_batch)"
        )
    for path, mod in module.named_modules():
        experts = getattr(mod, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        split = isinstance(experts, ExpertParallelExperts)
        held = experts.num_local if split else getattr(experts, "num_experts", None)
        total = getattr(experts, "num_experts", None)
        if isinstance(total, int) and held is not None and held * spec.ep != total:
            raise EstimateError(
                f'ep {spec.ep}: "{path}.experts" holds {held} of {total} experts; estimate the '
                "schedule as an ep rank holds it: slapo.sharding.expert_parallel(model, group) "
                f"over a group of ep ranks {how}"
            )


# torch.utils.checkpoint.checkpoint's own keywords; the others go to the function
_CHECKPOINT_OPTIONS = (
    "use_reentrant", "context_fn", "determinism_check", "debug", "preserve_rng_state",
    "early_stop",
)  # fmt: skip


@contextlib.contextmanager
def _checkpoints_run_plainly() -> Iterator[None]:
    """Run every ``torch.utils.checkpoint.checkpoint`` call (``slapo.checkpoint``'s included) as
    a plain call of its function, as a traced pipeline stage runs it."""
    import torch.utils.checkpoint as torch_checkpoint

    original = torch_checkpoint.checkpoint

    def plain(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        for option in _CHECKPOINT_OPTIONS:
            kwargs.pop(option, None)
        return function(*args, **kwargs)

    torch_checkpoint.checkpoint = plain
    try:
        yield
    finally:
        torch_checkpoint.checkpoint = original


def _microbatch(batch: Any, num_microbatches: int) -> Any:
    """The first of ``num_microbatches`` equal slices of ``batch`` along its first dimension."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] % num_microbatches:
            raise EstimateError(
                f"the batch's first dimension ({tuple(batch.shape)}) does not split into "
                f"{num_microbatches} microbatches"
            )
        return batch[: batch.shape[0] // num_microbatches]
    if isinstance(batch, Mapping):
        return {k: _microbatch(v, num_microbatches) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_microbatch(v, num_microbatches) for v in batch)
    return batch


def estimate_layout(
    sch: Any,
    batch: Any,
    *,
    target: str = "eager",
    dp: int = 1,
    pp: int = 1,
    tp: int = 1,
    rank: int = 0,
    num_microbatches: int = 1,
    pipeline_schedule: str = "1F1B",
    zero_stage: int = 2,
    reshard_after_forward: bool = True,
    devices: int = 1,
    prefetch: bool = False,
    precision: Any = None,
    cp: int = 1,
    ep: int = 1,
    **estimate_kwargs: Any,
) -> MemoryEstimate:
    """Predict the memory of one training step of rank ``rank`` of a ``dp x pp x cp x tp``
    layout (with ``ep`` expert parallelism).

    Args:
        sch: the schedule (its ``cut_pipeline_stage`` cuts make the stages when ``pp`` > 1);
            for ``tp`` > 1 built over a tensor-parallel group of that size
            (:func:`~slapo.memory.fake_process_group` in one process), as that rank's share;
            for ``cp`` > 1 its attention run over a context-parallel group
            (:func:`slapo.sharding.context_parallel`), for ``ep`` > 1 its experts split
            (:func:`slapo.sharding.expert_parallel`; groups in one process:
            :func:`~slapo.memory.fake_layout_groups`).
        batch: what one data-parallel rank trains on in a step (all its microbatches); with
            ``cp`` > 1 this cp rank's part of it (``ContextParallel.model_batch``).
        target, dp, pp, tp, cp, ep, rank, num_microbatches, pipeline_schedule, zero_stage,
        reshard_after_forward, devices, prefetch: see :class:`LayoutSpec`.
        precision: ``"fp32"`` (None) or mixed ``"bf16"``/``"fp16"``: float32 master weights and
            optimizer state, the compute dtype's activations, applied as the target's engine
            applies it (:attr:`LayoutSpec.casts_module`): FSDP2 shards float32 parameters and
            gathers them in the compute dtype; DeepSpeed and RoundPipe hold the module in the
            compute dtype beside float32 master copies; the others autocast.
        **estimate_kwargs: ``optimizer``, ``optimizer_kwargs``, ``loss_fn``, ``device`` of
            :func:`slapo.estimate_memory`.

    Returns:
        A :class:`~slapo.memory.MemoryEstimate` of that rank: ``target``, ``layout`` and
        ``stage`` say which; ``engine`` counts the engine's own buffers; ``device_resident``
        RoundPipe's device bytes.

    Example:
        >>> import slapo
        >>> import torch, transformers
        >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        ...     vocab_size=64, use_cache=False)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> ids = torch.randint(0, config.vocab_size, (4, 32))
        >>> batch = {"input_ids": ids, "labels": ids}
        >>> sch = slapo.create_schedule(model)
        >>> sch["model.layers.1"].cut_pipeline_stage()
        >>> est = slapo.estimate_layout(sch, batch, target="pipeline", pp=2, rank=0,
        ...                             num_microbatches=4, pipeline_schedule="GPipe")
        >>> est.stage, est.layout
        (0, {'dp': 1, 'pp': 2, 'tp': 1})
        >>> fsdp = slapo.estimate_layout(sch, batch, target="fsdp", dp=8, precision="bf16")
        >>> fsdp.precision, list(fsdp.engine_parts)
        ('bf16', ['fsdp gathered parameters'])
        >>> # a context-parallel layout: one rank of cp 2, its part of each sequence
        >>> import slapo.memory
        >>> from slapo.sharding.context_parallel import context_parallel
        >>> cp_model = transformers.LlamaForCausalLM(config)
        >>> with slapo.memory.fake_layout_groups(cp=2) as groups:
        ...     local = context_parallel(cp_model, groups["cp"]).model_batch(batch)
        ...     est = slapo.estimate_layout(cp_model, local, target="ddp", dp=2, cp=2)
        >>> est.layout
        {'dp': 2, 'pp': 1, 'tp': 1, 'cp': 2}
    """
    spec = LayoutSpec(
        target, dp, pp, tp, rank, num_microbatches, pipeline_schedule, zero_stage,
        reshard_after_forward, devices, prefetch, precision=precision or "fp32", cp=cp, ep=ep,
    )  # fmt: skip
    return apply_layout(layout_step(sch, batch, spec, **estimate_kwargs), sch, spec)


def layout_step(sch: Any, batch: Any, spec: LayoutSpec, **estimate_kwargs: Any) -> MemoryEstimate:
    """The fake step :func:`estimate_layout` runs for ``spec`` before :func:`apply_layout` models
    the engine: one microbatch of the whole model with ``pp`` > 1, its parameters cast as the
    target's engine casts them (:attr:`LayoutSpec.casts_module`).

    Example:
        >>> import slapo
        >>> import torch, transformers
        >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        ...     vocab_size=64, use_cache=False)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> ids = torch.randint(0, config.vocab_size, (4, 32))
        >>> batch = {"input_ids": ids, "labels": ids}
        >>> sch = slapo.create_schedule(model)
        >>> spec = LayoutSpec("fsdp", dp=8, precision="bf16")
        >>> base = layout_step(sch, batch, spec)
        >>> apply_layout(base, sch, spec) == slapo.estimate_layout(sch, batch, **spec.sizes(),
        ...     target="fsdp", precision="bf16")
        True
    """
    if "cast_params" in estimate_kwargs:
        raise EstimateError(
            "estimate_layout: cast_params follows from the target (LayoutSpec.casts_module); "
            "give target= and precision= instead"
        )
    step_batch = _microbatch(batch, spec.num_microbatches) if spec.pp > 1 else batch
    plain = spec.pp > 1 and not PIPELINE_STAGES_CHECKPOINT
    with _checkpoints_run_plainly() if plain else contextlib.nullcontext():
        return estimate_memory(
            sch, step_batch, precision=spec.precision, cast_params=spec.casts_module,
            **estimate_kwargs,
        )  # fmt: skip
