"""The ``"deepspeed"`` target: ZeRO stages 1-3 and pipeline stages on DeepSpeed's own engine.

``slapo.build(sch, target="deepspeed", config=ds_config, optimizer=...)`` returns DeepSpeed's
engine (``deepspeed.initialize``) and an optimizer that honour the training-loop contract of
:mod:`slapo.targets.contract`:

* without pipeline cuts, the engine is a ``DeepSpeedEngine`` training the scheduled model with
  the ZeRO stage of the config, over every rank, or over ``group=`` (the data-parallel
  dimension) when the schedule is tensor parallel (an ``mpu`` tells DeepSpeed both groups);
* with ``cut_pipeline_stage()`` cuts, the engine is DeepSpeed's ``PipelineEngine`` running a
  ``deepspeed.pipe.PipelineModule`` made of the stages the cuts define (ZeRO 0 or 1); weights
  tied across stages are declared as ``TiedLayerSpec`` (:mod:`slapo.targets.deepspeed_pipe`).

The mapping of the contract onto DeepSpeed's loop:

* ``slapo.train_step(engine, batch)`` runs ``engine.train_step(batch)``, which this target adds
  to DeepSpeed's engine: forward and ``engine.backward(loss)`` (ZeRO), or the pipeline
  schedule's forward and backward passes of every microbatch with the gradient reductions
  (pipeline). It returns the loss; the weights have not moved yet.
* ``optimizer.step()`` is DeepSpeed's step: ``engine.step()`` (ZeRO's reduction and update, the
  LR scheduler, gradient zeroing), or the pipeline schedule's ``OptimizerStep``.
* ``optimizer.zero_grad()`` zeroes what DeepSpeed holds (its step already did).

DeepSpeed's own loop (``engine.backward(loss); engine.step()``, ``engine.train_batch(it)``)
works on the same engine as well.

Registered whether or not DeepSpeed is installed, so that asking for it without DeepSpeed says
how to get it instead of "no such target".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..env import export_env
from ..exceptions import TargetError
from ..logger import get_logger
from ..precision import PRECISIONS, Precision
from ..primitives.cut_pipeline_stage import pipeline_cuts
from ..surgery import carry_signature
from .common import OptimizerSpec, as_process_group, make_optimizer, require_distributed
from .contract import Batch, output_loss, split_batch
from .target_registry import register_target

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = [
    "DeepSpeedOptimizer",
    "ParallelGroups",
    "build_deepspeed",
    "deepspeed_available",
    "named_parameters",
]

LossFn = Callable[[Any, Any], torch.Tensor]


def _import_deepspeed() -> Any:
    try:
        import deepspeed  # deferred: optional and heavy; asking for the target says how to get it
    except ImportError as exc:
        raise TargetError(
            'target "deepspeed" needs DeepSpeed, which is not installed: pip install deepspeed '
            f"(or pip install 'slapo[deepspeed]'); {type(exc).__name__}: {exc}"
        ) from exc
    return deepspeed


@register_target("deepspeed", distributed=True, precisions=PRECISIONS, memory="deepspeed")
def build_deepspeed(
    sch: Schedule,
    config: dict[str, Any] | str | Path | None = None,
    zero_stage: int | None = None,
    micro_batch_size: int | None = None,
    optimizer: OptimizerSpec = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    loss_fn: LossFn | None = None,
    group: Any = None,
    num_microbatches: int | None = None,
    example_inputs: Any = None,
    forward_kwargs: dict[str, Any] | None = None,
    precision: Precision | str | torch.dtype | None = None,
    **initialize_kwargs: Any,
) -> tuple[Any, DeepSpeedOptimizer | None]:
    """Train the scheduled model on DeepSpeed's engine; returns ``(engine, optimizer)``.

    Args:
        config: a DeepSpeed config (a dict, or the path of a JSON file). Slapo fills in, where
            the config says nothing: ``train_micro_batch_size_per_gpu`` (``micro_batch_size``,
            default 1; with pipeline cuts, the batch over ``num_microbatches``),
            ``gradient_clipping: 0`` (DeepSpeed 0.19 clips at 1.0 by default; every slapo
            target applies the optimizer to the gradients as they are), and
            ``zero_allow_untested_optimizer: true`` (``optimizer=`` takes any torch optimizer).
            With pipeline cuts and ``bf16``/``fp16`` enabled, the model is cast to that dtype
            before it is traced.
        zero_stage: 0, 1, 2 or 3; overrides ``config["zero_optimization"]["stage"]``. With
            pipeline cuts DeepSpeed allows 0 and 1.
        optimizer: an optimizer class or factory created over the model's parameters (else the
            config's ``"optimizer"`` section, if any, makes one).
        loss_fn: ``loss_fn(output, target)`` used by ``train_step`` (a mapping batch's
            ``"labels"``, a tuple's last item); default: the loss in the model's output.
            Required with pipeline cuts (the last stage's output, e.g. logits).
        group: the data-parallel group (a ProcessGroup or 1-D DeviceMesh, e.g. ``mesh["dp"]``)
            of a tensor-parallel schedule (``create_schedule(model, group=mesh["tp"])``); the
            two groups reach DeepSpeed as an ``mpu`` (:class:`ParallelGroups`). Without tensor
            parallelism ZeRO runs over every rank.
        num_microbatches: pipeline only: microbatches per batch (DeepSpeed's gradient
            accumulation steps); must divide the batch. With more ranks than stages, each
            data-parallel pipeline (``engine.grid.data_parallel_id``) trains on its own batch.
        example_inputs: pipeline only: one training batch's inputs (a tensor or a tuple, as the
            model's leading positional arguments), traced to split the model at its cuts;
            default ``create_schedule(..., example_inputs=...)``. Every batch has its shapes.
        forward_kwargs: pipeline only: constant keyword arguments of the traced forward
            (default ``{"use_cache": False}`` where the forward takes ``use_cache``).
        precision: ``"bf16"`` or ``"fp16"`` enables that section of the config (DeepSpeed's
            mixed precision: the module computes in that dtype, the optimizer keeps float32
            master weights and state; fp16 with DeepSpeed's dynamic loss scale, whose overflow
            check agrees over the ranks). A config that enables another one is refused.
        initialize_kwargs: passed on to ``deepspeed.initialize`` (``lr_scheduler=``,
            ``mpu=`` to give DeepSpeed your own groups, ...).

    The engine is DeepSpeed's own (``DeepSpeedEngine`` or ``PipelineEngine``) with a
    ``train_step(batch)`` added; the optimizer is a :class:`DeepSpeedOptimizer` over it (None
    when neither ``optimizer=`` nor the config makes one). See the module docstring for how
    the training-loop contract maps onto DeepSpeed's loop; :func:`named_parameters` lists this
    rank's parameters under the model's names.

    Example:
        >>> import slapo
        >>> import torch, transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
        ...                                  n_positions=16, bos_token_id=0, eos_token_id=0)
        >>> ids = torch.randint(0, config.vocab_size, (4, 8))
        >>> sch = slapo.create_schedule(transformers.GPT2LMHeadModel(config))
        >>> # illustration: every rank of a job started by torchrun or the deepspeed launcher
        >>> engine, opt = slapo.build(sch, target="deepspeed", zero_stage=2,  # doctest: +SKIP
        ...                           optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3})
        >>> loss = slapo.train_step(engine, {"input_ids": ids, "labels": ids})  # doctest: +SKIP
        >>> opt.step(); opt.zero_grad()  # doctest: +SKIP
    """
    deepspeed = _import_deepspeed()
    require_distributed("deepspeed")
    cfg = _precision_config(_config(config, zero_stage, micro_batch_size), Precision.of(precision))
    export_env()  # DeepSpeed reads LOCAL_RANK (and RANK, WORLD_SIZE) from the environment
    _start_comm(deepspeed)
    cuts = pipeline_cuts(sch)
    if cuts:
        from .deepspeed_pipe import build_pipeline_module

        _pipeline_only_options(group, initialize_kwargs, loss_fn)
        stage = cfg.get("zero_optimization", {}).get("stage", 0)
        if stage > 1:
            raise TargetError(
                f'target "deepspeed": ZeRO stage {stage} with pipeline cuts: DeepSpeed\'s '
                "pipeline engine runs ZeRO 0 or 1 only (its gradient partitioning does not fit "
                "the pipeline schedule); use zero_stage=1, or remove the cuts"
            )
        piped = build_pipeline_module(
            sch, cuts, example_inputs, num_microbatches, loss_fn, forward_kwargs, _dtype(cfg)
        )
        _set_pipeline_batch(cfg, piped.micro_batch_size, piped.num_microbatches)
        model: nn.Module = piped.module
    else:
        if num_microbatches is not None or example_inputs is not None:
            raise TargetError(
                'target "deepspeed": num_microbatches=/example_inputs= are for pipeline cuts, '
                "and the schedule has none (add one with cut_pipeline_stage())"
            )
        cfg.setdefault("train_micro_batch_size_per_gpu", micro_batch_size or 1)
        if "mpu" not in initialize_kwargs:
            mpu = _mpu(sch, group)
            if mpu is not None:
                initialize_kwargs["mpu"] = mpu
        model = sch.mod
    opt = make_optimizer(model, optimizer, optimizer_kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        engine, ds_opt, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, model_parameters=params, config=cfg, **initialize_kwargs
        )
    except (TypeError, ValueError, AssertionError, *_config_errors()) as exc:
        raise TargetError(
            f'target "deepspeed": deepspeed.initialize rejected the config {cfg}: '
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if cuts:
        from .deepspeed_pipe import PipelineTrainStep

        engine.train_step = PipelineTrainStep(engine, piped)
    else:
        engine.train_step = _ZeroTrainStep(engine, loss_fn)
        # DeepSpeed's forward(*inputs, **kwargs) shows the model's own (the pipeline engine's
        # forward only raises: it trains through train_batch)
        carry_signature(engine, model)
    if dist.get_rank() == 0:
        get_logger().info(
            "deepspeed: %s, ZeRO stage %d over %d data-parallel ranks",
            type(engine).__name__,
            engine.zero_optimization_stage(),
            engine.dp_world_size,
        )
    if ds_opt is None:
        return engine, None
    return engine, DeepSpeedOptimizer(engine, pipeline=bool(cuts))


# ----- the training-loop contract ----------------------------------------------------------------
class _ZeroTrainStep:
    """``engine.train_step(batch)`` of a ZeRO engine: forward, then ``engine.backward(loss)``."""

    def __init__(self, engine: Any, loss_fn: LossFn | None) -> None:
        self.engine = engine
        self.loss_fn = loss_fn

    def __call__(self, batch: Batch) -> torch.Tensor:
        args, kwargs, target = split_batch(batch, with_target=self.loss_fn is not None)
        out = self.engine(*args, **kwargs)
        loss = output_loss(out) if self.loss_fn is None else self.loss_fn(out, target)
        self.engine.backward(loss)
        return loss.detach()


class DeepSpeedOptimizer:
    """The optimizer ``build`` returns for the ``"deepspeed"`` target: DeepSpeed's step.

    ``step()`` is ``engine.step()`` (ZeRO: reduce, update, zero the gradients, step the LR
    scheduler given to ``deepspeed.initialize``), or the pipeline engine's optimizer step;
    ``zero_grad()`` zeroes the gradients DeepSpeed holds. DeepSpeed's optimizer (a ZeRO
    optimizer around the torch one) is :attr:`optimizer`; ``param_groups``, ``state``,
    ``state_dict()`` and ``load_state_dict()`` are its.

    Example:
        >>> import slapo
        >>> import torch, transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
        ...                                  n_positions=16, bos_token_id=0, eos_token_id=0)
        >>> ids = torch.randint(0, config.vocab_size, (4, 8))
        >>> sch = slapo.create_schedule(transformers.GPT2LMHeadModel(config))
        >>> batch = {"input_ids": ids, "labels": ids}
        >>> # illustration: every rank of a job started by torchrun or the deepspeed launcher
        >>> engine, opt = slapo.build(sch, target="deepspeed", zero_stage=1,  # doctest: +SKIP
        ...                           optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
        >>> loss = slapo.train_step(engine, batch)  # doctest: +SKIP
        >>> opt.step(); opt.zero_grad()  # doctest: +SKIP
    """

    def __init__(self, engine: Any, pipeline: bool = False) -> None:
        self.engine = engine
        self.pipeline = pipeline

    @property
    def optimizer(self) -> Any:
        """DeepSpeed's optimizer (``engine.optimizer``)."""
        return self.engine.optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    @property
    def state(self) -> Any:
        return getattr(self.engine.optimizer, "state", {})

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Apply the gradients of the last ``train_step`` (DeepSpeed's step)."""
        if closure is not None:
            raise TargetError('target "deepspeed": optimizer.step() takes no closure')
        if not self.pipeline:
            self.engine.step()
            return
        # The pipeline engine runs its step as an instruction of the train schedule, which
        # train_step leaves out so that the step is this call (deepspeed_pipe.PipelineTrainStep).
        self.engine._exec_optimizer_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients DeepSpeed holds (its step already did)."""
        engine = self.engine
        if engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled():
            engine.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            engine.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.optimizer.load_state_dict(state)


def named_parameters(engine: Any) -> Iterator[tuple[str, nn.Parameter]]:
    """This rank's parameters under their names in the user's model.

    A ZeRO engine's module is the model itself. A pipeline engine's module names its layers
    (``"0.stage.transformer.h.0..."``) and tied weights (``"tied_modules.<key>.weight"``); they
    are given back their model names here, a tied weight once under each name its stages use.
    Under ZeRO-3 the parameters are partitioned: gather them with
    ``deepspeed.zero.GatheredParameters`` to read them whole.

    Example:
        >>> import slapo
        >>> import torch, transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
        ...                                  n_positions=16, bos_token_id=0, eos_token_id=0)
        >>> ids = torch.randint(0, config.vocab_size, (4, 8))
        >>> sch = slapo.create_schedule(transformers.GPT2LMHeadModel(config))
        >>> # illustration: a DeepSpeed engine, built on every rank of a job; not run here
        >>> engine, _ = slapo.build(sch, target="deepspeed", zero_stage=1)  # doctest: +SKIP
        >>> dict(named_parameters(engine))["transformer.wte.weight"].shape  # doctest: +SKIP
        torch.Size([96, 32])
    """
    from deepspeed.pipe import PipelineModule

    from .deepspeed_pipe import pipeline_named_parameters

    module = engine.module
    if isinstance(module, PipelineModule):
        yield from pipeline_named_parameters(module)
    else:
        yield from module.named_parameters()


# ----- groups ------------------------------------------------------------------------------------
class ParallelGroups:
    """The ``mpu`` DeepSpeed reads its process groups from: tensor (model) and data parallel.

    DeepSpeed reduces gradients and partitions ZeRO state over the data-parallel group, and
    sums gradient norms over the model-parallel one. ``build`` makes one from the schedule's
    tensor-parallel group and ``group=``.

    Example:
        >>> import slapo
        >>> # illustration: each rank of a 4-rank job (torchrun) with dp=2, tp=2; not run here
        >>> mesh = slapo.sharding.init_parallel_mesh("cpu", dp=2, tp=2)  # doctest: +SKIP
        >>> tp, dp = mesh["tp"].get_group(), mesh["dp"].get_group()  # doctest: +SKIP
        >>> mpu = ParallelGroups(tp=tp, dp=dp)  # doctest: +SKIP
        >>> mpu.get_data_parallel_world_size()  # doctest: +SKIP
        2
    """

    def __init__(self, tp: dist.ProcessGroup, dp: dist.ProcessGroup) -> None:
        self.tp, self.dp = tp, dp

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.tp

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.tp)

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.tp)

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_global_rank(self.tp, 0)

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.dp)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.dp)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.dp)


def _mpu(sch: Schedule, group: Any) -> ParallelGroups | None:
    """The groups of a tensor-parallel schedule, or None: ZeRO over every rank."""
    world = dist.get_world_size()
    dp = as_process_group(group, "deepspeed")
    tp = as_process_group(sch.group, "deepspeed") if sch.group is not None else None
    tp_size = dist.get_world_size(tp) if tp is not None else 1
    if tp_size == 1:
        if dp is not None and dist.get_world_size(dp) != world:
            raise TargetError(
                f'target "deepspeed": group= spans {dist.get_world_size(dp)} of {world} ranks, '
                "but the schedule is not tensor parallel: ZeRO runs over every rank; drop "
                "group=, or schedule with create_schedule(model, group=mesh['tp'])"
            )
        return None
    if dp is None:
        raise TargetError(
            f'target "deepspeed": the schedule is tensor parallel over {tp_size} ranks; pass '
            "the data-parallel group too, e.g. group=mesh['dp'] of the mesh whose 'tp' "
            "dimension the schedule uses"
        )
    dp_size = dist.get_world_size(dp)
    if tp_size * dp_size != world:
        raise TargetError(
            f'target "deepspeed": tensor-parallel size {tp_size} x data-parallel size '
            f"{dp_size} (group=) must be the {world} ranks"
        )
    return ParallelGroups(tp, dp)


# ----- config ------------------------------------------------------------------------------------
def _config(config: Any, zero_stage: int | None, micro_batch_size: int | None) -> dict[str, Any]:
    if zero_stage is not None and zero_stage not in (0, 1, 2, 3):
        raise TargetError(f'target "deepspeed": zero_stage= must be 0, 1, 2 or 3, got {zero_stage}')
    if micro_batch_size is not None and (
        not isinstance(micro_batch_size, int) or micro_batch_size < 1
    ):
        raise TargetError(
            f'target "deepspeed": micro_batch_size= must be a positive int, got {micro_batch_size!r}'
        )
    if isinstance(config, (str, Path)):
        path = Path(config)
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise TargetError(
                f'target "deepspeed": config="{path}" is not a readable JSON file: {exc}'
            ) from exc
    if config is not None and not isinstance(config, dict):
        raise TargetError(
            f'target "deepspeed": config= takes a dict or a JSON file path, got '
            f"{type(config).__name__}"
        )
    cfg = dict(config or {})
    if zero_stage is not None:
        cfg["zero_optimization"] = {**cfg.get("zero_optimization", {}), "stage": zero_stage}
    cfg.setdefault("gradient_clipping", 0.0)
    cfg.setdefault("zero_allow_untested_optimizer", True)
    return cfg


def _precision_config(cfg: dict[str, Any], precision: Precision) -> dict[str, Any]:
    """``cfg`` with ``precision``'s section enabled (bf16, or fp16 with a dynamic loss scale)."""
    enabled = _dtype(cfg)
    if not precision.mixed:
        return cfg
    if enabled is not None and enabled != precision.compute_dtype:
        raise TargetError(
            f'target "deepspeed": precision={precision.name!r}, but the config enables '
            f"{enabled}; keep one"
        )
    section = {"enabled": True}
    if precision.loss_scaling:
        section["loss_scale"] = 0  # dynamic, as torch's GradScaler
    return {**cfg, precision.name: {**section, **cfg.get(precision.name, {})}}


def _dtype(cfg: dict[str, Any]) -> torch.dtype | None:
    """The dtype DeepSpeed runs the model in: bf16 or fp16 when the config enables one."""
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if cfg.get(key, {}).get("enabled") is True:
            return dtype
    return None


def _set_pipeline_batch(cfg: dict[str, Any], micro: int, n: int) -> None:
    """The pipeline's micro batch and accumulation steps come from the traced batch."""
    for key, value in (
        ("train_micro_batch_size_per_gpu", micro),
        ("gradient_accumulation_steps", n),
    ):
        given = cfg.setdefault(key, value)
        if given != value:
            raise TargetError(
                f'target "deepspeed": the config\'s {key}={given}, but the pipeline was traced '
                f"for {value} (example_inputs= over num_microbatches=); drop it from the config"
            )
    cfg.pop("train_batch_size", None)  # DeepSpeed derives it: micro x steps x data parallel


def _pipeline_only_options(group: Any, initialize_kwargs: dict[str, Any], loss_fn: Any) -> None:
    if group is not None or "mpu" in initialize_kwargs:
        raise TargetError(
            'target "deepspeed": group=/mpu= with pipeline cuts: the pipeline engine lays out '
            "its stages and data-parallel replicas over every rank itself; drop them"
        )
    if loss_fn is None:
        raise TargetError(
            'target "deepspeed": pipeline cuts need loss_fn=(last stage output, target) -> '
            "scalar, e.g. the causal LM loss of the logits"
        )


# ----- starting DeepSpeed ------------------------------------------------------------------------
def _config_errors() -> tuple[type[Exception], ...]:
    """What DeepSpeed raises for a config it cannot run (besides ValueError and asserts)."""
    from deepspeed.runtime.config import DeepSpeedConfigError
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    return DeepSpeedConfigError, ZeRORuntimeException


def _start_comm(deepspeed: Any) -> None:
    """Start DeepSpeed's communication backend on the running process group.

    On its CPU accelerator DeepSpeed would first JIT-compile its shared-memory all-reduce
    (``deepspeed_shm_comm``: C++, about 40 s the first time, needs a compiler and ninja), which
    only its inference all-reduce uses; training runs on the gloo group, so it is left out.
    """
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator

    if comm.is_initialized():
        return
    if get_accelerator().device_name() != "cpu":
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        return
    from deepspeed import ops

    compatible = ops.__compatible_ops__  # one dict, read when the backend starts
    before = compatible.get("deepspeed_shm_comm")
    compatible["deepspeed_shm_comm"] = False
    try:
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    finally:
        compatible["deepspeed_shm_comm"] = before


def deepspeed_available() -> bool:
    """Whether DeepSpeed can be imported (its tests skip otherwise).

    Example:
        >>> import contextlib, io
        >>> with contextlib.redirect_stdout(io.StringIO()):  # its first import prints a note
        ...     available = deepspeed_available()
        >>> isinstance(available, bool)
        True
    """
    try:
        _import_deepspeed()
    except TargetError:
        return False
    return True
