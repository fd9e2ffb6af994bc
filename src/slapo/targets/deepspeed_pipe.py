"""Pipeline cuts on DeepSpeed's pipeline engine: a ``PipelineModule`` of the cut stages.

The model is traced and split after every ``cut_pipeline_stage`` (``slapo.pipeline.
partition_model``, as the ``"pipeline"`` target does). Each stage becomes one DeepSpeed layer
(:class:`DeepSpeedStage`), built only on the ranks of its stage; a weight tied across stages
(GPT-2's ``wte``/``lm_head``) becomes a ``TiedLayerSpec`` after each stage that uses it, and
the stages read it from DeepSpeed's tied module, whose gradient DeepSpeed sums over the tied
stages (``ReduceTiedGrads``).

DeepSpeed passes a tuple of tensors between stages and treats every floating-point one as an
activation with a gradient. A stage output without one (Llama's rotary ``cos``/``sin``, a
boolean mask) is sent bit-cast to an integer tensor of the same width and cast back by the
next stage, so DeepSpeed neither runs backward through it nor waits for its gradient.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..exceptions import TargetError
from ..pipeline import find_tie_groups, partition_model
from .contract import TARGET_KEY, Batch, split_batch
from .pipeline import _forward_kwargs, _positional_names  # the same capture rules

if TYPE_CHECKING:
    from ..schedule import Schedule

__all__ = [
    "DeepSpeedStage",
    "PipedModel",
    "PipelineTrainStep",
    "build_pipeline_module",
    "pipeline_named_parameters",
]

# Floating-point dtypes and the integer dtype of the same width they travel as.
_CARRIER = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


class DeepSpeedStage(nn.Module):
    """One pipeline stage as a DeepSpeed layer: a tuple of tensors in, a tuple out.

    ``carried[i]`` is the dtype input ``i`` had before the previous stage bit-cast it (None:
    it arrives as it is); ``send[i]`` says whether output ``i`` is bit-cast for the trip
    (None on the last stage, whose output goes to the loss as it is).

    Example:
        >>> class Stage(nn.Module):   # a traced stage: the ids in, a hidden state and a mask out
        ...     def forward(self, ids):
        ...         return ids.float() * 2, ids > 0
        >>> layer = DeepSpeedStage(Stage(), carried=(None,), send=(False, True))
        >>> hidden, mask_as_uint8 = layer(torch.tensor([[3, 0]]))
        >>> hidden, mask_as_uint8    # the bool mask travels as uint8
        (tensor([[6., 0.]]), tensor([[1, 0]], dtype=torch.uint8))
    """

    def __init__(
        self,
        stage: nn.Module,
        carried: tuple[torch.dtype | None, ...],
        send: tuple[bool, ...] | None,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.carried = carried
        self.send = send

    def forward(self, inputs: Any) -> Any:
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        args = tuple(_arrive(x, dtype) for x, dtype in zip(args, self.carried, strict=True))
        out = self.stage(*args)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if self.send is not None:
            outs = tuple(_depart(t, cast) for t, cast in zip(outs, self.send, strict=True))
        return outs[0] if len(outs) == 1 else outs


def _depart(t: torch.Tensor, cast: bool) -> torch.Tensor:
    if not cast:
        return t.contiguous()  # send/recv need contiguous tensors
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.detach().contiguous().view(_CARRIER[t.dtype])


def _arrive(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None:
        return t
    return t.bool() if dtype == torch.bool else t.view(dtype)


class _TiedWeight(nn.Module):
    """The module DeepSpeed builds once per rank for a ``TiedLayerSpec``: the tied weight."""

    def __init__(self, value: torch.Tensor, requires_grad: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(value.detach().clone(), requires_grad=requires_grad)


def _pass_through(_tied: nn.Module, inputs: Any) -> Any:
    """A tied layer's forward: the stage before it reads the weight; the data passes on."""
    return inputs


@dataclass
class PipedModel:
    """The ``PipelineModule`` built from the cuts, and what training it needs."""

    module: nn.Module
    micro_batch_size: int
    num_microbatches: int
    input_names: tuple[str, ...]  # the forward's leading positional parameters the stages take
    input_shapes: list[tuple[int, ...]]  # of one whole batch


def build_pipeline_module(
    sch: Schedule,
    cuts: list[str],
    example_inputs: Any,
    num_microbatches: int | None,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    forward_kwargs: dict[str, Any] | None,
    dtype: torch.dtype | None = None,
) -> PipedModel:
    """Trace the model on the first microbatch of ``example_inputs``, split it at the cuts and
    make the stages a ``deepspeed.pipe.PipelineModule`` over every rank.

    The traced graphs check the devices and dtypes they were traced with, so the model is
    traced where DeepSpeed runs the stages (the accelerator's device of ``LOCAL_RANK``) and in
    ``dtype``, the dtype of DeepSpeed's ``bf16``/``fp16`` modes. On an accelerator, the
    parameters of the stages other ranks run go back to the CPU after the build.

    Example:
        >>> import slapo
        >>> import torch, transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
        ...                                  n_positions=16, bos_token_id=0, eos_token_id=0)
        >>> ids = torch.randint(0, config.vocab_size, (4, 8))
        >>> sch = slapo.create_schedule(transformers.GPT2LMHeadModel(config))
        >>> def loss_fn(logits, y):
        ...     return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        >>> # illustration: every rank of a 2-stage job under the deepspeed launcher; not run here
        >>> cuts = ["transformer.h.0"]
        >>> piped = build_pipeline_module(sch, cuts, (ids,), 2, loss_fn, None)  # doctest: +SKIP
        >>> piped.micro_batch_size == ids.shape[0] // 2  # doctest: +SKIP
        True
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    model = sch.mod
    if any(r.name in ("shard", "sync") for r in sch.root.metadata.primitives):
        raise TargetError(
            'target "deepspeed": pipeline cuts with tensor-parallel primitives (shard/sync) are '
            'not wired to DeepSpeed\'s pipeline engine; use target="pipeline" with a ("pp", '
            '"tp") mesh, or tensor parallelism with ZeRO (no cuts)'
        )
    inputs = example_inputs if example_inputs is not None else sch.extra.get("example_inputs")
    if inputs is None:
        raise TargetError(
            'target "deepspeed": pipeline cuts need example_inputs= (one training batch\'s '
            "inputs, e.g. (input_ids,)) to trace the stages and size DeepSpeed's microbatches"
        )
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if not inputs or not all(isinstance(x, torch.Tensor) and x.dim() > 0 for x in inputs):
        raise TargetError(
            'target "deepspeed": example_inputs= must be a tensor or a tuple of tensors with a '
            "batch dimension"
        )
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise TargetError(
            f'target "deepspeed": pipeline cuts need num_microbatches= (a positive int), got '
            f"{num_microbatches!r}"
        )
    batch = inputs[0].shape[0]
    if batch % num_microbatches:
        raise TargetError(
            f'target "deepspeed": num_microbatches={num_microbatches} does not divide the batch '
            f"of {batch} (example_inputs=)"
        )
    world = dist.get_world_size()
    num_stages = len(cuts) + 1
    if world % num_stages:
        raise TargetError(
            f'target "deepspeed": {num_stages} pipeline stages do not divide the {world} ranks; '
            "DeepSpeed runs world / stages data-parallel pipelines"
        )
    micro = batch // num_microbatches
    device = torch.device(get_accelerator().device_name(int(os.environ["LOCAL_RANK"])))
    first = tuple(x[:micro].to(device) for x in inputs)
    kwargs = _forward_kwargs(model, forward_kwargs)
    model.to(device=device, dtype=dtype)
    part = partition_model(model, cuts, first, kwargs)
    sends, dtypes = _probe_sends(part.stages, first)
    ties = find_tie_groups(model, part.stages)
    keys = {t.names: _tie_key(t.names) for t in ties}

    layers: list[Any] = []
    expected = [0]
    carried: tuple[torch.dtype | None, ...] = tuple(None for _ in first)
    for s, stage in enumerate(part.stages):
        send = sends[s] if s < num_stages - 1 else None
        layers.append(LayerSpec(DeepSpeedStage, stage, carried, send))
        for tie in ties:
            if s in tie.stages:
                held = _held(stage, tie.names)
                layers.append(
                    TiedLayerSpec(
                        keys[tie.names],
                        _TiedWeight,
                        held.detach(),
                        held.requires_grad,
                        forward_fn=_pass_through,
                        tied_weight_attr=["weight"],
                    )
                )
        expected.append(len(layers))
        if send is not None:  # what the next stage restores
            carried = tuple(d if cast else None for d, cast in zip(dtypes[s], send, strict=True))
    # no_grad: DeepSpeed broadcasts the tied weights in place when it builds the module, which
    # autograd would otherwise record on them (and warn about in every backward).
    with torch.no_grad():
        pipe = PipelineModule(
            layers,
            num_stages=num_stages,
            loss_fn=loss_fn,
            partition_method=f"type:^{DeepSpeedStage.__name__}$",
        )
    parts = [int(p) for p in pipe.parts]
    if parts != expected:  # DeepSpeed balanced the layers otherwise than one stage per part
        raise TargetError(
            f'target "deepspeed": DeepSpeed partitioned the {len(layers)} pipeline layers as '
            f"{parts}, not one cut stage per pipeline stage ({expected})"
        )
    _share_tied_weights(pipe, ties, keys)
    if device.type != "cpu":
        _others_to_cpu(pipe, [model, *part.stages])
    return PipedModel(
        module=pipe,
        micro_batch_size=micro,
        num_microbatches=num_microbatches,
        input_names=_positional_names(model)[: len(inputs)],
        input_shapes=[tuple(x.shape) for x in inputs],
    )


def _others_to_cpu(pipe: nn.Module, modules: list[nn.Module]) -> None:
    """Move the parameters and buffers this rank's stage does not use back to the CPU."""
    mine = {id(t) for t in (*pipe.parameters(), *pipe.buffers())}
    with torch.no_grad():
        for mod in modules:
            for t in (*mod.parameters(), *mod.buffers()):
                if id(t) not in mine and t.device.type != "cpu":
                    t.data = t.data.cpu()


def _probe_sends(
    stages: Sequence[nn.Module], first: tuple[torch.Tensor, ...]
) -> tuple[list[tuple[bool, ...]], list[tuple[torch.dtype, ...]]]:
    """Run the stages once on the microbatch: which outputs of each stage (but the last) are
    bit-cast for the trip to the next, and their dtypes.

    An output is sent as it is when it carries a gradient (a floating-point tensor computed
    from parameters or gradient-carrying inputs) or is an integer tensor; floating-point and
    boolean tensors without a gradient are bit-cast. The run uses a forked RNG state, so
    dropout draws nothing from the training's stream.
    """
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    sends: list[tuple[bool, ...]] = []
    dtypes: list[tuple[torch.dtype, ...]] = []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        x: tuple = first
        for stage in stages[:-1]:
            out = stage(*x)
            outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            for i, t in enumerate(outs):
                if not isinstance(t, torch.Tensor):
                    raise TargetError(
                        f'target "deepspeed": pipeline stage {len(sends)} returns a '
                        f"{type(t).__name__} at output {i}; DeepSpeed passes only tensors "
                        "between stages: cut elsewhere"
                    )
            sends.append(tuple(_cast(t) for t in outs))
            dtypes.append(tuple(t.dtype for t in outs))
            x = outs
    return sends, dtypes


def _cast(t: torch.Tensor) -> bool:
    if t.dtype == torch.bool:
        return True
    if t.is_floating_point():
        if t.dtype not in _CARRIER:
            raise TargetError(
                f'target "deepspeed": a pipeline stage passes a {t.dtype} tensor; DeepSpeed '
                f"carries {sorted(str(d) for d in _CARRIER)} and integer tensors"
            )
        return not t.requires_grad
    return False


def _tie_key(names: frozenset[str]) -> str:
    return min(names).replace(".", "__")  # a ModuleDict key holds no dots


def _held(stage: nn.Module, names: frozenset[str]) -> nn.Parameter:
    for name, p in stage.named_parameters(remove_duplicate=False):
        if name in names:
            return p
    raise AssertionError(f"no stage parameter named {sorted(names)}")  # find_tie_groups found one


def _share_tied_weights(pipe: nn.Module, ties: list, keys: dict) -> None:
    """Point each local stage's copy of a tied weight at DeepSpeed's tied module's weight."""
    for layer in pipe.forward_funcs:
        if not isinstance(layer, DeepSpeedStage):
            continue
        for tie in ties:
            key = keys[tie.names]
            if key not in pipe.tied_modules:
                continue
            weight = pipe.tied_modules[key].weight
            for name, _ in list(layer.stage.named_parameters(remove_duplicate=False)):
                if name in tie.names:
                    owner, _, leaf = name.rpartition(".")
                    setattr(layer.stage.get_submodule(owner), leaf, weight)


def pipeline_named_parameters(pipe: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """This rank's parameters of a :func:`build_pipeline_module` pipeline, by model name."""
    seen: set[str] = set()
    for layer in pipe.forward_funcs:
        if isinstance(layer, DeepSpeedStage):
            for name, p in layer.stage.named_parameters(remove_duplicate=False):
                if name not in seen:
                    seen.add(name)
                    yield name, p


# ----- training --------------------------------------------------------------------------------
class _WithoutOptimizerStep:
    """A pipeline schedule with its ``OptimizerStep`` instruction left out."""

    def __init__(self, schedule: Any) -> None:
        self.schedule = schedule

    def num_pipe_buffers(self) -> int:
        return self.schedule.num_pipe_buffers()

    def __iter__(self) -> Iterator[list[Any]]:
        from deepspeed.runtime.pipe.schedule import OptimizerStep

        for cmds in self.schedule:
            yield [c for c in cmds if not isinstance(c, OptimizerStep)]


class PipelineTrainStep:
    """``engine.train_step(batch)`` of a pipeline engine: every microbatch's forward and
    backward and the gradient reductions (DeepSpeed's ``train_batch`` without its optimizer
    step, which the optimizer's ``step()`` runs); returns the batch's mean loss on every rank.

    A mapping batch gives the traced inputs by the forward's parameter names and the target as
    ``"labels"``; a tuple is ``(inputs..., target)``. Every rank of a pipeline passes the same
    batch (the first stage reads the inputs, the last the target).

    Example:
        >>> import slapo
        >>> import torch, transformers
        >>> config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
        ...                                  n_positions=16, bos_token_id=0, eos_token_id=0)
        >>> ids = torch.randint(0, config.vocab_size, (4, 8))
        >>> sch = slapo.create_schedule(transformers.GPT2LMHeadModel(config))
        >>> sch["transformer.h.0"].cut_pipeline_stage()
        >>> # illustration: every rank of a 2-stage job under the deepspeed launcher; not run here
        >>> engine, opt = slapo.build(sch, target="deepspeed", zero_stage=1)  # doctest: +SKIP
        >>> loss = engine.train_step({"input_ids": ids, "labels": ids})  # doctest: +SKIP
    """

    def __init__(self, engine: Any, piped: PipedModel) -> None:
        # Two methods of DeepSpeed's PipelineEngine split train_batch into the contract's
        # train_step and optimizer.step: _train_schedule came in 0.19.8 (0.19.0-0.19.7 build the
        # schedule inside train_batch), hence the project's lower bound.
        missing = [m for m in ("_train_schedule", "_exec_optimizer_step") if not hasattr(engine, m)]
        if missing:
            raise TargetError(
                f'target "deepspeed": this DeepSpeed\'s PipelineEngine has no {missing}, which '
                "slapo's train_step and optimizer.step() run; train with engine.train_batch() "
                "or use DeepSpeed 0.19.8 or newer"
            )
        self.engine = engine
        self.piped = piped

    def __call__(self, batch: Batch) -> torch.Tensor:
        inputs, target = self._inputs(batch)
        p = self.piped
        shapes = [tuple(x.shape) for x in inputs]
        if shapes != p.input_shapes:
            raise TargetError(
                f'target "deepspeed": the batch has inputs of shapes {shapes}, but the pipeline '
                f"was traced for {p.input_shapes} (example_inputs=): every batch has its shapes"
            )
        m = p.micro_batch_size
        micro = [
            (_one(tuple(x[i * m : (i + 1) * m] for x in inputs)), _slice(target, i * m, m))
            for i in range(p.num_microbatches)
        ]
        engine = self.engine
        engine._train_schedule = lambda: _WithoutOptimizerStep(type(engine)._train_schedule(engine))
        try:
            loss = engine.train_batch(iter(micro))
        finally:
            del engine._train_schedule
        return loss.detach()

    def _inputs(self, batch: Batch) -> tuple[tuple[torch.Tensor, ...], Any]:
        args, kwargs, target = split_batch(batch, with_target=True)
        names = self.piped.input_names[len(args) :]
        extra = sorted(set(kwargs) - set(names))
        if extra:
            raise TargetError(
                f'target "deepspeed": the batch has {extra}, but the pipeline stages take '
                f"{list(self.piped.input_names)} plus the target {TARGET_KEY!r}: drop them "
                "(constant arguments go to forward_kwargs= at build)"
            )
        missing = [n for n in names if n not in kwargs]
        if missing:
            raise TargetError(
                f'target "deepspeed": the batch lacks {missing}, which the pipeline was traced '
                "with (example_inputs=)"
            )
        return (*args, *(kwargs[n] for n in names)), target


def _one(xs: tuple[torch.Tensor, ...]) -> Any:
    return xs[0] if len(xs) == 1 else xs


def _slice(target: Any, start: int, size: int) -> Any:
    if isinstance(target, torch.Tensor):
        return target[start : start + size]
    if isinstance(target, (tuple, list)):
        return tuple(t[start : start + size] for t in target)
    raise TargetError(
        f'target "deepspeed": the pipeline\'s target must be a tensor or a tuple of tensors, '
        f"got {type(target).__name__}"
    )
